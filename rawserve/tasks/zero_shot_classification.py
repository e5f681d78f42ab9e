"""zero-shot-classification: text and candidate labels in; `[{label, score}]` out.

The pipeline answers `{sequence, labels, scores}`; the Inference API (and so
InferenceClient) a list of `{label, score}`, best first: the item is reshaped.
"""

from __future__ import annotations

from typing import Any

from rawserve.tasks.checks import LABEL_SCORES, boolean, short_text, text, text_list
from rawserve.tasks.rules import Task


def label_score_pairs(output: Any) -> Any:
    """The pipeline's {sequence, labels, scores} → the Inference API's [{label, score}]."""
    if isinstance(output, dict) and "labels" in output:
        return [
            {"label": label, "score": score}
            for label, score in zip(output["labels"], output["scores"], strict=True)
        ]
    return output


TASK = Task(
    "zero-shot-classification",
    text,
    {
        "candidate_labels": text_list(100),
        "multi_label": boolean,
        "hypothesis_template": short_text,
    },
    required_params=frozenset({"candidate_labels"}),
    shape_item=label_score_pairs,
    output_schema=LABEL_SCORES,
)

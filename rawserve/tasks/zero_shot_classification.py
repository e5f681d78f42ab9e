"""zero-shot-classification: text and candidate labels in; `[{label, score}]` out.

The pipeline answers `{sequence, labels, scores}`; the Inference API (and so
InferenceClient) a list of `{label, score}`, best first: the item is reshaped.
"""

from __future__ import annotations

import string
from collections.abc import Mapping
from typing import Any

from rawserve.tasks.checks import LABEL_SCORES, boolean, checker, short_text, text, text_list
from rawserve.tasks.estimate import text_tokens
from rawserve.tasks.rules import Task

DEFAULT_TEMPLATE = "This example is {}."  # the pipeline's

ONE_PLACE = 'must hold one "{}", where each label goes (and no other braces: "{{" writes one)'


@checker({"type": "string", "minLength": 1, "maxLength": 1000, "pattern": "[{][0]?[}]"})
def hypothesis_template(value: Any) -> str:
    """A sentence with one plain `{}` for the label (the pipeline fills it with
    `str.format`: any other field would fail, or reach into the label's attributes)."""
    template = short_text(value)
    try:
        fields = [parts[1:] for parts in string.Formatter().parse(template) if parts[1] is not None]
    except ValueError:
        raise ValueError(ONE_PLACE) from None
    if len(fields) != 1 or fields[0] not in (("", "", None), ("0", "", None)):
        raise ValueError(ONE_PLACE)
    return template


LABELS = text_list(100)


@checker(LABELS.schema)
def candidate_labels(value: Any) -> list[str]:
    """A list of labels, or one text of them separated by commas, split as the pipeline
    splits it (`"urgent, not urgent"` is two labels)."""
    if isinstance(value, str):
        value = [label.strip() for label in value.split(",") if label.strip()]
    labels = LABELS(value)
    # the pipeline tells a template that takes no label by its text unchanged once filled:
    # with the label "{}" it is, and transformers blamed the template
    if placeholder := next((label for label in labels if label in ("{}", "{0}")), None):
        raise ValueError(f"a label cannot be {placeholder!r}, the template's place for one")
    return labels


def pairs_tokens(
    labels: list[Any], params: Mapping[str, Any], tokens: int, limit: int | None
) -> int:
    """The tokens the model reads for a text of `tokens` tokens: one (text, hypothesis)
    pair per label, each cut at `limit`. Counted as the text's tokens once per label,
    20 labels of 60 characters to the text "hello" were a 24th of the work. Measured,
    not formatted: a handler's parameters are its own, unchecked (a template such as
    "{:100000000}" would be formatted on the event loop)."""
    template = params.get("hypothesis_template")
    if not isinstance(template, str):
        template = DEFAULT_TEMPLATE
    try:  # (joined in C: a handler may be sent 200,000 labels)
        label_tokens = text_tokens("".join(labels))
    except TypeError:  # not all texts: a handler's own labels
        label_tokens = 0
    pairs = len(labels) * (tokens + 1 + text_tokens(template)) + label_tokens
    if limit is not None:
        pairs = min(pairs, len(labels) * limit)
    return pairs or tokens


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
        "candidate_labels": candidate_labels,
        "multi_label": boolean,
        "hypothesis_template": hypothesis_template,
    },
    required_params=frozenset({"candidate_labels"}),
    shape_item=label_score_pairs,
    output_schema=LABEL_SCORES,
)

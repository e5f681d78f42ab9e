"""zero-shot-classification's hypotheses checked before the request is queued: each label
goes into `hypothesis_template`, and the model reads the text and one hypothesis
together, the text cut to make room. A hypothesis that leaves the text no room cannot be
read at all; left to the worker, it was refused only after the request's other pairs ran
(32 texts and 100 labels: 9 s), in words that blamed the text ("the input is 483
tokens"). Counted here with the model's own tokenizer it is refused in milliseconds, in
words that name the template and the label.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rawserve.api.served import ServedModel
from rawserve.api.tokens import ServerTokenizers
from rawserve.http.errors import UnprocessableInput
from rawserve.tasks.windows import MOST_TOKENS_PER_CHARACTER
from rawserve.tasks.zero_shot_classification import DEFAULT_TEMPLATE

SHOWN_CHARACTERS = 60  # of a hypothesis, in the refusal's words


async def check_hypotheses(
    tokenizers: ServerTokenizers,
    model: ServedModel,
    texts: Sequence[Any],
    params: Mapping[str, Any],
) -> None:
    """422 where a label's hypothesis, with the pair's special tokens, leaves no room for
    a token of any of `texts` in the model's positions (none can be read with it: the
    tokenizer refuses); nothing where the model or its tokenizer is not known here (the
    worker refuses it)."""
    labels = params.get("candidate_labels")
    template = params.get("hypothesis_template", DEFAULT_TEMPLATE)
    window = model.positions
    if not window or not isinstance(labels, list) or not isinstance(template, str):
        return
    # (the checks let one "{}" through, for the label: formatted as the pipeline does)
    hypotheses = [template.format(label) for label in labels]
    if max(map(len, hypotheses), default=0) * MOST_TOKENS_PER_CHARACTER < window // 2:
        return  # surely room: not counted
    tokenizer = await tokenizers.get(model)
    if tokenizer is None:
        return
    room = window - tokenizer.pair_special_tokens
    # (a text that reads as no token, a lone combining accent, leaves the hypothesis all)
    most = room - any(isinstance(t, str) and tokenizer.count_past(t, 1) for t in texts)
    for hypothesis in hypotheses:
        if tokenizer.count_past(hypothesis, room) > most:
            raise UnprocessableInput(
                f"the hypothesis {shortened(hypothesis)!r} is longer than the {most} tokens "
                f"the model reads beside a text (of its {window}): no text fits with it: "
                "send a shorter hypothesis_template or label",
                param="hypothesis_template",
            )


def shortened(text: str) -> str:
    return text if len(text) <= SHOWN_CHARACTERS else text[: SHOWN_CHARACTERS - 3] + "..."

"""A request's windows bounded before it is queued (`tasks.windows`): token
classification's `stride` and question answering's `doc_stride` read a long text in
windows that overlap, and a stride close to the window makes one every token or two. A
request whose windows would hold more than the budget is refused (422) here, counted with
the model's own tokenizer a piece at a time, in milliseconds; left to the worker, its
tokenizer made every window at once (a 1 MB text at stride 125 of 128 positions: 9 GB).
Where the model's tokenizer is not known here, the worker refuses it in the same words.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rawserve.api.prompts import by_length
from rawserve.api.served import ServedModel
from rawserve.api.tokens import ServerTokenizer, ServerTokenizers
from rawserve.http.errors import UnprocessableInput
from rawserve.tasks import question_answering, token_classification
from rawserve.tasks.windows import (
    MOST_TOKENS_PER_CHARACTER,
    context_rooms,
    surely_fit,
    too_many_windows,
    windows_fit,
)

WINDOWED_TASKS = frozenset({"token-classification", "question-answering"})


async def check_windows(
    tokenizers: ServerTokenizers,
    model: ServedModel,
    inputs: Sequence[Any],
    params: Mapping[str, Any],
) -> None:
    """422 when the windows of the request's texts would hold more tokens than
    `WINDOW_TOKEN_BUDGET`; nothing when the model is not known yet (the worker checks)."""
    if not model.positions:
        return
    if model.task == "token-classification":
        await check_text_windows(tokenizers, model, inputs, params)
    elif model.task == "question-answering":
        await check_context_windows(tokenizers, model, inputs, params)


async def check_text_windows(
    tokenizers: ServerTokenizers,
    model: ServedModel,
    inputs: Sequence[Any],
    params: Mapping[str, Any],
) -> None:
    """token-classification's: only with a `stride` (without, a text is cut to one window)."""
    stride = params.get("stride")
    if not isinstance(stride, int):
        return
    window = model.positions
    room = window - token_classification.SPECIAL_TOKENS
    texts = [(text, room) for text in inputs if isinstance(text, str)]
    if room - stride < 1 or surely_fit(texts, window, stride):
        return  # (a stride that leaves no window room: the worker refuses it in its words)
    tokenizer = await tokenizers.get(model)
    if tokenizer is None:
        return
    words = [text for text, _ in texts]
    if not await by_length(words, windows_fit, tokenizer.count_past, texts, window, stride):
        raise UnprocessableInput(too_many_windows(window, "stride", stride), param="stride")


async def check_context_windows(
    tokenizers: ServerTokenizers,
    model: ServedModel,
    inputs: Sequence[Any],
    params: Mapping[str, Any],
) -> None:
    """question-answering's: each context's windows follow its question in `max_seq_len`
    tokens, overlapping by `doc_stride` (the pipeline's defaults where not given)."""
    window = params.get("max_seq_len")
    if not isinstance(window, int):
        window = min(model.positions, question_answering.MAX_SEQ_LEN)
    stride = params.get("doc_stride")
    if not isinstance(stride, int):
        stride = min(window // 2, question_answering.DOC_STRIDE)
    items = [item for item in inputs if isinstance(item, dict)]
    if not items:
        return
    # each question at the most tokens its characters could make: the least room left
    special = question_answering.SPECIAL_TOKENS
    bounds = [
        (item["context"], window - special - MOST_TOKENS_PER_CHARACTER * len(item["question"]))
        for item in items
    ]
    if surely_fit(bounds, window, stride):
        return
    tokenizer = await tokenizers.get(model)
    if tokenizer is None:
        return
    words = [item["context"] for item in items]
    fits = await by_length(words, contexts_fit, tokenizer, items, window, stride)
    if not fits:
        raise UnprocessableInput(
            too_many_windows(window, "doc_stride", stride, "context"), param="doc_stride"
        )


def contexts_fit(
    tokenizer: ServerTokenizer, items: Sequence[Mapping[str, str]], window: int, stride: int
) -> bool:
    """Whether the contexts' windows fit the budget, each after its question's tokens."""
    count = tokenizer.count_past
    rooms = context_rooms(count, items, window, question_answering.SPECIAL_TOKENS, stride)
    return windows_fit(count, rooms, window, stride)

"""A prompt's several generations (OpenAI's `n` choices, TGI's `best_of` answers), each
queued with parameters of its own and all at once; a prompt's answers come back one
after another. Server process; never imports torch.
"""

from __future__ import annotations

import asyncio
from typing import Any

from rawserve.api.served import ServedModel
from rawserve.serving.face import ItemResult


async def run_choices(
    model: ServedModel,
    prompts: list[Any],
    choices: list[dict[str, Any]],
    deadline: float,
) -> list[ItemResult]:
    """Each prompt's choices, one after another: the prompts queued once for each choice's
    parameters, all at once (batched together where they are the same)."""
    if len(choices) == 1:
        return await model.run(prompts, choices[0], deadline)
    runs = [asyncio.ensure_future(model.run(prompts, params, deadline)) for params in choices]
    try:
        answered = await asyncio.gather(*runs)
    finally:  # one refused or failed (or its client gone): the others are withdrawn
        for run in runs:
            run.cancel()
    return [answered[j][i] for i in range(len(prompts)) for j in range(len(choices))]

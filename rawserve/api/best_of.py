"""TGI's and OpenAI's `best_of`: several sampled answers of one prompt, the likeliest of
them given.

Each answer is a generation of its own, queued as an item (as the OpenAI routes' `n`
choices are), each sampled with a seed of its own; the answer whose new tokens' log
probabilities add up highest is given, as TGI picks it, and with `details` the others
follow under its `best_of_sequences`. TGI's validation is kept: `best_of` above 1 only
with sampling, without a `seed` (every answer would be the same), and never streamed.
OpenAI's completions' `best_of` answers the `n` of its generations with the highest log
probability per token, as OpenAI ranks them (`likeliest_choices`). Server process; never
imports torch.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping, Sequence
from typing import Any

from rawserve.api.choices import run_choices
from rawserve.api.outcomes import unwrap_all
from rawserve.api.served import ServedModel
from rawserve.http.errors import BadRequest, PayloadTooLarge
from rawserve.serving.face import ItemResult
from rawserve.shared.messages import ItemFailure
from rawserve.shared.token_columns import logprob_sum
from rawserve.tasks.text_generation import tgi_output

# what TGI reads as asking for sampling, beside `do_sample`
SAMPLING_SETTINGS = ("temperature", "top_k", "top_p", "typical_p")


def asked_copies(
    params: Mapping[str, Any],
    prompts: int,
    most: int,
    streamed: bool,
    admitted: int | None = None,
) -> int:
    """How many answers each of `prompts` prompts is generated (1 where `best_of` is not
    asked); 400 (TGI's clients read 422 "validation") where TGI refuses the request, or
    where the answers together are more than `most` (--max-client-batch-size) items;
    413 where they are more than admission ever takes of one request (`admitted`: the
    queue, and the rows of workers that take one item at a time), as for OpenAI's `n`:
    a 503 would invite retries that all fail."""
    copies = int(params.get("best_of") or 1)
    if copies == 1:
        return 1
    if streamed:
        raise BadRequest("best_of above 1 is not allowed when the answer streams")
    if not (params.get("do_sample") or any(params.get(name) for name in SAMPLING_SETTINGS)):
        raise BadRequest("best_of above 1 needs sampling (do_sample, or a sampling setting)")
    if params.get("seed") is not None:
        raise BadRequest("seed must not be set when best_of is above 1")
    made = copies * prompts
    makes = f"best_of {copies} for {prompts} prompt{'s' if prompts > 1 else ''} makes {made}"
    if made > most:
        raise BadRequest(
            f"{makes} generations, and one request may ask at most {most} (--max-client-batch-size)"
        )
    if admitted is not None and made > admitted:
        raise PayloadTooLarge(
            f"{makes} generations, and this server takes at most {admitted} of one request "
            "(--max-queue, and the rows of workers that take one item at a time)"
        )
    return copies


def copy_params(params: Mapping[str, Any], copies: int) -> list[dict[str, Any]]:
    """The worker's parameters for each of a prompt's `copies` answers: `best_of` left
    out (the server's to read); details asked for (the best is chosen by its tokens' log
    probabilities); sampling on (TGI's check takes a temperature of 1 as asking for it,
    which alone the worker would decode greedily, every answer the same); and a seed of
    its own drawn for each, so that each differs and its details' `seed` repeats it, on
    the static path too (whose rows drawn together would have none to tell)."""
    worker = {name: value for name, value in params.items() if name != "best_of"}
    worker.update(details=True, do_sample=True)
    return [{**worker, "seed": secrets.randbits(64)} for _ in range(copies)]


async def run_copies(
    model: ServedModel,
    prompts: list[Any],
    params: Mapping[str, Any],
    copies: int,
    deadline: float,
) -> list[ItemResult]:
    """The prompts' answers, each prompt's `copies` of them one after another (one: as
    `params` ask, unchanged)."""
    if copies == 1:
        return await model.run(prompts, params, deadline)
    return await run_choices(model, prompts, copy_params(params, copies), deadline)


def repeated(inputs: Sequence[Any], copies: int) -> list[Any]:
    """Each input `copies` times in a row, as its answers come."""
    return [item for item in inputs for _ in range(copies)]


def best_of_each(results: Sequence[ItemResult], copies: int, details: bool) -> list[Any]:
    """The outputs, one for each prompt, from its `copies` results in a row (each
    the pipeline's `[{"generated_text", "details"}]`): its best answer (`best_output`),
    or the HTTP error of a failed one, named as the prompt's (of several, its index)."""
    groups = [results[start : start + copies] for start in range(0, len(results), copies)]
    first_failed = [
        next((each for each in group if isinstance(each.output, ItemFailure)), group[0])
        for group in groups
    ]
    unwrap_all(first_failed)
    return [[best_output([each.output[0] for each in group], details)] for group in groups]


def best_output(outputs: Sequence[Any], details: bool) -> Any:
    """Of one prompt's answers (each the worker's `{"generated_text", "details"}`), the
    one whose new tokens' log probabilities add up highest (the first of equals, as
    TGI's picks it); with `details` the others follow in order, in TGI's shape, under its
    details' `best_of_sequences`, else it goes without details (asked for the choice)."""
    if len(outputs) == 1:
        return outputs[0]
    chances = [logprob_sum(output["details"]["tokens"]) for output in outputs]
    best = max(range(len(outputs)), key=lambda index: (chances[index], -index))
    chosen = outputs[best]
    if not details:
        return {name: value for name, value in chosen.items() if name != "details"}
    others = [tgi_output(output) for index, output in enumerate(outputs) if index != best]
    sequences = [{"generated_text": o["generated_text"], **o["details"]} for o in others]
    return {**chosen, "details": {**chosen["details"], "best_of_sequences": sequences}}


def likeliest_choices(outputs: Sequence[Any], generations: int, n: int) -> list[Any]:
    """Of each prompt's `generations` outputs in a row (the worker's `{"generated_text",
    "details"}`, its tokens listed), the `n` whose new tokens have the highest log
    probability per token, OpenAI's `best_of` order: likeliest first (the earlier of
    equals), a prompt's after another's."""
    chosen = []
    for start in range(0, len(outputs), generations):
        group = outputs[start : start + generations]
        ranks = sorted(range(len(group)), key=lambda index: (-per_token(group[index]), index))
        chosen += [group[index] for index in ranks[:n]]
    return chosen


def per_token(output: Mapping[str, Any]) -> float:
    """An output's mean log probability over its new tokens (0 where it has none)."""
    details = output["details"]
    return logprob_sum(details["tokens"]) / max(int(details["generated_tokens"]), 1)

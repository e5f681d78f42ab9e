"""vLLM's way to cut inputs, read on its pooling routes (`/classify`, `/score`,
`/v1/rerank`) and on OpenAI's `/v1/embeddings`: `truncate_prompt_tokens` -1 cuts an
input to the model's length, N to N tokens (special tokens included), and
`truncation_side` says which end is kept ("right", the default: the start).

What a route does with an input longer than the model takes, where nothing is asked, is
its own: vLLM's pooling routes refuse it, the embeddings cut it. Server process; plain
Python.
"""

from __future__ import annotations

from typing import Any

from rawserve.api.fields import Field, Fields, one_of, read_integer
from rawserve.api.routing import DocContext
from rawserve.api.served import ServedModel
from rawserve.http.errors import BadRequest
from rawserve.tasks import TRUNCATE_TO

TRUNCATE_PROMPT_TOKENS = "truncate_prompt_tokens"
TRUNCATION_SIDE = "truncation_side"
MOST_TOKENS = 2**31 - 1


def read_truncation(name: str, value: Any, context: DocContext | None) -> int:
    keep = read_integer(name, value, -1, MOST_TOKENS)
    if keep == 0:
        raise BadRequest(f'"{name}" must be -1 or a count of tokens above 0')
    return keep


def cut_fields(absent: str) -> dict[str, Field]:
    """The two fields, `absent` saying what an input longer than the model takes meets
    where `truncate_prompt_tokens` is not given."""
    return {
        TRUNCATE_PROMPT_TOKENS: Field(
            {"anyOf": [{"type": "integer", "minimum": 1}, {"enum": [-1, None]}]},
            read_truncation,
            description="Cut each input to this many tokens, special tokens included (-1: "
            f"to the model's length); none: {absent}.",
        ),
        TRUNCATION_SIDE: one_of(("right", "left"), "right"),
    }


def asked_cut(model: ServedModel, fields: Fields, cuts: bool = False) -> dict[str, Any] | None:
    """The worker's parameters of the cut a body asks (None: it asks none); 400 for more
    than the model's length (0 is refused as it is read). `cuts`: the route cuts an input
    to the model's length where no `truncate_prompt_tokens` is given, on the side asked
    (the embeddings: a left side was not kept)."""
    keep = fields.value(TRUNCATE_PROMPT_TOKENS)
    side = fields.value(TRUNCATION_SIDE)
    if keep is None:
        return {"truncate": True, "truncation_direction": side} if cuts else None
    positions = model.positions
    if positions > 0 and keep > positions:
        raise BadRequest(
            f'"{TRUNCATE_PROMPT_TOKENS}" is {keep}, more than the model\'s length '
            f"({positions} tokens)",
            param=TRUNCATE_PROMPT_TOKENS,
        )
    fewer = {} if keep == -1 or keep == positions else {TRUNCATE_TO: keep}
    return {"truncate": True, "truncation_direction": side, **fewer}

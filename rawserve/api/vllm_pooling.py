"""vLLM's pooling routes beside its rerank (`/v1/rerank`, rawserve.api.tei): `/classify`,
each input's probabilities over a text-classification model's labels, and `/score`, a
score per pair of texts (a cross-encoder's relevance, or the cosine of a
feature-extraction model's vectors), both also under `/v1/`, answered in vLLM's shapes
with their `usage`. Their errors are OpenAI's object, as vLLM's are.

`/score` pairs its two sides as vLLM does: one text against each of a list, or two lists
of one length pairwise; the sides are `text_1` and `text_2`, or `queries` with
`documents` or `items`, or `data_1` and `data_2`. An input longer than the model takes is
refused (422) before it is queued, unless `truncate_prompt_tokens` cuts it: -1 to the
model's length, N to N tokens (special tokens included). As on TEI's routes, fields
these routes do not read are ignored. Server process; plain Python.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import numpy as np

from rawserve.api.bodies import answer, check_client_batch, read_json
from rawserve.api.context import RouteContext
from rawserve.api.fields import Body, Field, Fields, flag, item_name, read_integer, text
from rawserve.api.openai_generation import is_token_ids
from rawserve.api.outcomes import unwrap_all
from rawserve.api.prompts import check_input_lengths
from rawserve.api.routing import (
    DENSE_EMBEDDING,
    MODEL_ERRORS,
    DocContext,
    Needs,
    Operation,
    Route,
    Schema,
)
from rawserve.api.served import ServedModel
from rawserve.api.tei import CLASSIFIER, CROSS_ENCODER, labels_of, scores
from rawserve.api.tei_bodies import checked_texts, max_inputs
from rawserve.http.errors import BadRequest, EmptyInput
from rawserve.http.exchange import HttpRequest, HttpResponse
from rawserve.serving.face import EMBEDDING_ROUTE
from rawserve.tasks import LOGITS_PARAM, TRUNCATE_TO

TAG = "vLLM"
CLASSIFY_PATHS = ("/classify", "/v1/classify")
SCORE_PATHS = ("/score", "/v1/score")
SCORER = Needs(
    what="a cross-encoder (text-classification with one label) or a feature-extraction model "
    "of dense vectors",
    any_of=(CROSS_ENCODER, DENSE_EMBEDDING),
)
# the names of /score's two sides, as vLLM's versions have called them
SCORE_SIDES = (("text_1", "text_2"), ("queries", "documents"), ("queries", "items"),
               ("data_1", "data_2"))  # fmt: skip
TRUNCATE_PROMPT_TOKENS = "truncate_prompt_tokens"
MOST_TOKENS = 2**31 - 1


def read_texts(name: str, value: Any, context: DocContext | None) -> list[str]:
    """A text or a non-empty list of them (token ids are not served here: 400)."""
    texts = [value] if isinstance(value, str) else value
    if texts == []:
        raise EmptyInput(f'"{name}" must be a text or a non-empty list of texts')
    if not isinstance(texts, list) or not all(isinstance(one, str) for one in texts):
        if isinstance(texts, list) and (is_token_ids(texts) or all(map(is_token_ids, texts))):
            raise BadRequest(f'"{name}" as token ids is not served: send the text')
        raise BadRequest(f'"{name}" must be a text or a non-empty list of texts')
    check_client_batch(len(texts), max_inputs(context))
    return checked_texts(texts, f'"{name}"')


def texts_schema(context: DocContext) -> Schema:
    many = {"type": "array", "items": {"type": "string"}, "minItems": 1}
    return {"oneOf": [{"type": "string"}, {**many, "maxItems": context.max_inputs}]}


def read_truncation(name: str, value: Any, context: DocContext | None) -> int:
    return read_integer(name, value, -1, MOST_TOKENS)


TEXTS = Field(texts_schema, read_texts)
TRUNCATION = Field(
    {"type": ["integer", "null"], "minimum": -1},
    read_truncation,
    description="Cut each input to this many tokens, special tokens included (-1: to the "
    "model's length); none: an input longer than the model takes is refused (422).",
)
ACTIVATION = {
    name: flag(True, "Scores as probabilities (a softmax, or a sigmoid for one label); "
               "false: the model's logits.") if name == "use_activation" else flag(True)
    for name in ("use_activation", "activation", "softmax")  # (vLLM's older names)
}  # fmt: skip
CLASSIFY = Body(
    {
        "input": Field(texts_schema, read_texts, reads_null=True, required=True),
        TRUNCATE_PROMPT_TOKENS: TRUNCATION,
        **ACTIVATION,
        "user": text(),
    },
    ignore_unknown=True,
)
SCORE = Body(
    {
        **{name: TEXTS for pair in SCORE_SIDES for name in pair},
        TRUNCATE_PROMPT_TOKENS: TRUNCATION,
        **ACTIVATION,
        "user": text(),
    },
    ignore_unknown=True,
    description="Two sides of texts: text_1 and text_2, queries and documents (or items), "
    "or data_1 and data_2; one text of the first against each of the second, or two lists "
    "of one length pairwise.",
)
USAGE: Schema = {
    "type": "object",
    "required": ["prompt_tokens", "total_tokens", "completion_tokens"],
    "properties": {
        "prompt_tokens": {"type": "integer", "minimum": 0},
        "total_tokens": {"type": "integer", "minimum": 0},
        "completion_tokens": {"const": 0},
        "prompt_tokens_details": {"type": "null"},
    },
}


def listing(kind: str, item: Schema) -> Schema:
    """vLLM's answer of a list: `{id, object: "list", created, model, data, usage}`."""
    return {
        "type": "object",
        "required": ["id", "object", "created", "model", "data", "usage"],
        "properties": {
            "id": {"type": "string", "pattern": f"^{kind}-"},
            "object": {"const": "list"},
            "created": {"type": "integer"},
            "model": {"type": "string"},
            "data": {"type": "array", "items": item},
            "usage": USAGE,
        },
    }


CLASSIFY_RESPONSE = listing(
    "classify",
    {
        "type": "object",
        "required": ["index", "label", "probs", "num_classes"],
        "properties": {
            "index": {"type": "integer", "minimum": 0},
            "label": {"type": "string"},
            "probs": {"type": "array", "items": {"type": "number"}},
            "num_classes": {"type": "integer", "minimum": 1},
        },
    },
)
SCORE_RESPONSE = listing(
    "score",
    {
        "type": "object",
        "required": ["index", "object", "score"],
        "properties": {
            "index": {"type": "integer", "minimum": 0},
            "object": {"const": "score"},
            "score": {"type": "number"},
        },
    },
)


class VllmPoolingRoutes:
    def __init__(self, context: RouteContext):
        self.context = context

    def routes(self) -> list[Route]:
        def post(path: str, handler: Any, needs: Needs, summary: str, body: Body,
                 response: Schema) -> Route:  # fmt: skip
            operation = Operation(
                f"{summary} (vLLM)", TAG, body.schema, lambda _: response, errors=MODEL_ERRORS
            )
            return Route("POST", path, handler, operation, needs, queued=True)

        return [
            *(
                post(path, self.classify, CLASSIFIER, "Each label's probability, per input",
                     CLASSIFY, CLASSIFY_RESPONSE)
                for path in CLASSIFY_PATHS
            ),
            *(
                post(path, self.score, SCORER, "A score per pair of texts", SCORE,
                     SCORE_RESPONSE)
                for path in SCORE_PATHS
            ),
        ]  # fmt: skip

    async def classify(self, request: HttpRequest) -> HttpResponse:
        """Each input's probabilities over the model's labels, and the likeliest label."""
        fields = CLASSIFY.read(read_json(request))
        model = self.context.model_for(fields.get("model"), CLASSIFIER, queued_for=request)
        texts = fields.value("input", self.within(model))
        params = {LOGITS_PARAM: True, **await self.truncation(model, fields, texts, "input")}
        results = await model.run(texts, params, self.context.deadline(request))
        outputs = unwrap_all(results)
        labels = labels_of(model)
        raw = not activated(fields)
        data = []
        for index, output in enumerate(outputs):
            probs = scores(output["logits"], raw)
            best = str(int(np.argmax(probs)))
            data.append({
                "index": index,
                "label": labels.get(best, f"LABEL_{best}"),
                "probs": [float(p) for p in probs],
                "num_classes": int(probs.size),
            })  # fmt: skip
        return answer(listed("classify", model, data, outputs), results)

    async def score(self, request: HttpRequest) -> HttpResponse:
        """A score per pair: a cross-encoder's of each pair, or the cosine of the two
        texts' vectors."""
        fields = SCORE.read(read_json(request))
        model = self.context.model_for(fields.get("model"), SCORER, queued_for=request)
        (first, firsts), (second, seconds) = sides(fields, self.within(model))
        named = {  # what a failure calls a text: its first place in the body
            text: item_name(f'"{name}"', index, len(side))
            for name, side in ((second, seconds), (first, firsts))
            for index, text in reversed([*enumerate(side)])
        }
        if len(firsts) == 1:
            firsts = firsts * len(seconds)
        deadline = self.context.deadline(request)
        if CROSS_ENCODER.missing(model) is None:
            pairs = [{"text": a, "text_pair": b} for a, b in zip(firsts, seconds, strict=True)]
            params = {LOGITS_PARAM: True, **await self.truncation(model, fields, pairs, second)}
            results = await model.run(pairs, params, deadline)
            names = [item_name(f'"{second}"', i, len(pairs)) for i in range(len(pairs))]
            outputs = unwrap_all(results, names)
            raw = not activated(fields)
            found = [float(scores(output["logits"], raw)[0]) for output in outputs]
        else:
            texts = [*dict.fromkeys([*firsts, *seconds])]  # each text embedded once
            params = {"normalize": True, **await self.truncation(model, fields, texts, first)}
            results = await model.run(texts, params, deadline, EMBEDDING_ROUTE)
            outputs = unwrap_all(results, [named[text] for text in texts])
            vectors = {
                one: np.asarray(output["embedding"], dtype=np.float64)
                for one, output in zip(texts, outputs, strict=True)
            }
            # (unit vectors in float32: a cosine may come out a little past 1)
            found = [
                float(np.clip(vectors[a] @ vectors[b], -1, 1))
                for a, b in zip(firsts, seconds, strict=True)
            ]
        data = [{"index": i, "object": "score", "score": one} for i, one in enumerate(found)]
        return answer(listed("score", model, data, outputs), results)

    def within(self, model: ServedModel) -> DocContext:
        return DocContext(model, self.context.settings.max_client_batch_size)

    async def truncation(
        self, model: ServedModel, fields: Fields, inputs: list[Any], name: str
    ) -> dict[str, Any]:
        """The worker's parameters of `truncate_prompt_tokens`; without it, 422 for an
        input longer than the model takes, before it is queued (`name`: its field)."""
        keep = fields.value(TRUNCATE_PROMPT_TOKENS)
        if keep is None:
            says = f"the model takes at most {{limit}}: send {TRUNCATE_PROMPT_TOKENS} to cut it"
            names = [item_name(f'"{name}"', index, len(inputs)) for index in range(len(inputs))]
            await check_input_lengths(self.context.tokenizers, model, inputs, says, names)
            return {"truncate": False}
        return {"truncate": True, **cut_to(model, keep)}


def cut_to(model: ServedModel, keep: int) -> dict[str, Any]:
    """The worker's parameter of a `truncate_prompt_tokens` of -1 (none: the model's
    length) or N tokens; 400 for 0, or more than the model's length."""
    positions = model.positions
    if keep == 0:
        raise BadRequest(
            f'"{TRUNCATE_PROMPT_TOKENS}" must be -1 or a count of tokens above 0',
            param=TRUNCATE_PROMPT_TOKENS,
        )
    if positions > 0 and keep > positions:
        raise BadRequest(
            f'"{TRUNCATE_PROMPT_TOKENS}" is {keep}, more than the model\'s length '
            f"({positions} tokens)",
            param=TRUNCATE_PROMPT_TOKENS,
        )
    return {} if keep == -1 or keep == positions else {TRUNCATE_TO: keep}


def sides(fields: Fields, context: DocContext) -> tuple[tuple[str, list[str]], ...]:
    """/score's two sides, each its field's name and texts: of one text, or of a list as
    long as the other (vLLM's 1:1, 1:N and N:N)."""
    present = {name for pair in SCORE_SIDES for name in pair if fields.get(name) is not None}
    whole = [pair for pair in SCORE_SIDES if set(pair) <= present]
    if len(whole) != 1 or present != set(whole[0]):
        partners = [
            other for pair in SCORE_SIDES for other in pair if set(pair) - {other} == present
        ]
        if len(present) == 1 and partners:
            wanted = " or ".join(f'"{name}"' for name in partners)
            raise BadRequest(f'{wanted} is required beside "{present.pop()}"')
        names = ", ".join(f"{one} and {other}" for one, other in SCORE_SIDES)
        raise BadRequest(f"send one pair of sides, one of: {names}")
    first, second = whole[0]
    firsts = fields.value(first, context)
    seconds = fields.value(second, context)
    if len(firsts) > 1 and len(firsts) != len(seconds):
        raise BadRequest(
            f'"{first}" has {len(firsts)} texts and "{second}" {len(seconds)}: send one text '
            f"against a list, or two lists of one length"
        )
    return (first, firsts), (second, seconds)


def activated(fields: Fields) -> bool:
    """Whether scores are probabilities: unless one of vLLM's names says false."""
    return all(fields.value(name) for name in ACTIVATION)


def listed(kind: str, model: ServedModel, data: list[Any], outputs: list[Any]) -> dict[str, Any]:
    """vLLM's answer of `data`, its usage counted from the worker's `tokens`."""
    tokens = sum(int(output["tokens"]) for output in outputs)
    return {
        "id": f"{kind}-{uuid.uuid4().hex}",
        "object": "list",
        "created": int(time.time()),
        "model": model.name,
        "data": data,
        "usage": {
            "prompt_tokens": tokens,
            "total_tokens": tokens,
            "completion_tokens": 0,
            "prompt_tokens_details": None,
        },
    }

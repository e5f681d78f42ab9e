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
from rawserve.api.fields import Body, Field, Fields, flag, item_name, text, texts_schema
from rawserve.api.openai_generation import is_token_ids
from rawserve.api.outcomes import unwrap_all
from rawserve.api.prompt_cuts import TRUNCATE_PROMPT_TOKENS, asked_cut, cut_fields
from rawserve.api.prompts import by_length, check_input_lengths
from rawserve.api.routing import (
    DENSE_EMBEDDING,
    MODEL_ERRORS,
    DocContext,
    Needs,
    Operation,
    Route,
    Schema,
)
from rawserve.api.sentence_prompts import prompted
from rawserve.api.served import ServedModel
from rawserve.api.tei import CLASSIFIER, CROSS_ENCODER, labels_of, scores
from rawserve.api.tei_bodies import checked_texts, max_inputs
from rawserve.api.tokens import ServerTokenizer
from rawserve.http.errors import BadRequest, EmptyInput, UnprocessableInput
from rawserve.http.exchange import HttpRequest, HttpResponse
from rawserve.serving.face import EMBEDDING_ROUTE
from rawserve.tasks import LOGITS_PARAM
from rawserve.tasks.windows import TOKENS_PER_CHARACTER

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
# what these routes do with an input longer than the model takes, where no cut is asked
REFUSED = "an input longer than the model takes is refused (422)"
SAYS = f"the model takes at most {{limit}}: send {TRUNCATE_PROMPT_TOKENS} to cut it"


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


TEXTS = Field(texts_schema, read_texts)
ACTIVATION = {
    "use_activation": flag(
        True,
        "Scores as probabilities (a softmax, or a sigmoid for one label); false: the "
        "model's logits.",
    ),
    "activation": flag(True),  # (vLLM's older names of it)
    "softmax": flag(True),
}
CLASSIFY = Body(
    {
        "input": Field(texts_schema, read_texts, reads_null=True, required=True),
        **cut_fields(REFUSED),
        **ACTIVATION,
        "user": text(),
    },
    ignore_unknown=True,
)
SCORE = Body(
    {
        **{name: TEXTS for pair in SCORE_SIDES for name in pair},
        **cut_fields(REFUSED),
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
        fields.value("user")
        cut = asked_cut(model, fields)
        if cut is None:
            await self.refuse_long(model, texts, names_of("input", texts))
        params = {LOGITS_PARAM: True, **(cut or {"truncate": False})}
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
        fields.value("user")
        first_names, second_names = names_of(first, firsts), names_of(second, seconds)
        cut = asked_cut(model, fields)
        deadline = self.context.deadline(request)
        if CROSS_ENCODER.missing(model) is None:
            if cut is None:  # each text, then each pair, as long as the model takes
                await self.refuse_long(model, [*firsts, *seconds], [*first_names, *second_names])
                await self.refuse_long_pairs(model, (first, firsts), (second, seconds))
            names = pair_names((first, firsts), (second, seconds))
            firsts = broadcast(firsts, seconds)
            pairs = [{"text": a, "text_pair": b} for a, b in zip(firsts, seconds, strict=True)]
            params = {LOGITS_PARAM: True, **(cut or {"truncate": False})}
            results = await model.run(pairs, params, deadline)
            outputs = unwrap_all(results, names)
            raw = not activated(fields)
            found = [float(scores(output["logits"], raw)[0]) for output in outputs]
        else:
            named = {  # each text embedded once, called by its first place in the body
                text: name
                for side, names in ((seconds, second_names), (firsts, first_names))
                for text, name in reversed([*zip(side, names, strict=True)])
            }
            texts = [*dict.fromkeys([*firsts, *seconds])]
            inputs = [*prompted(model, texts, None)]  # the model's default prompt, if any
            names = [named[text] for text in texts]
            if cut is None:
                await self.refuse_long(model, inputs, names)
            params = {"normalize": True, **(cut or {"truncate": False})}
            results = await model.run(inputs, params, deadline, EMBEDDING_ROUTE)
            outputs = unwrap_all(results, names)
            vectors = {
                one: np.asarray(output["embedding"], dtype=np.float64)
                for one, output in zip(texts, outputs, strict=True)
            }
            firsts = broadcast(firsts, seconds)
            # (unit vectors in float32: a cosine may come out a little past 1)
            found = [
                float(np.clip(vectors[a] @ vectors[b], -1, 1))
                for a, b in zip(firsts, seconds, strict=True)
            ]
        data = [{"index": i, "object": "score", "score": one} for i, one in enumerate(found)]
        return answer(listed("score", model, data, outputs), results)

    def within(self, model: ServedModel) -> DocContext:
        return DocContext(model, self.context.settings.max_client_batch_size)

    async def refuse_long(self, model: ServedModel, texts: list[str], names: list[str]) -> None:
        """422 before the work for a text longer than the model takes, named as `names`
        say (left to the worker, it was tokenized whole, and again as its batch split)."""
        await check_input_lengths(self.context.tokenizers, model, texts, SAYS, names)

    async def refuse_long_pairs(self, model: ServedModel, *sides: tuple[str, list[str]]) -> None:
        """422 before the work for a pair whose texts fit the model each alone but not
        together (the worker's refusal said "send truncate: true", which /score does not
        read, and came after the pair had queued)."""
        positions = model.positions
        if positions < 1:  # (a model naming none)
            return
        (_, firsts), (second, seconds) = sides
        pairs = [*zip(broadcast(firsts, seconds), seconds, strict=True)]
        maybe = [
            index
            for index, (a, b) in enumerate(pairs)
            if TOKENS_PER_CHARACTER * (len(a) + len(b)) > positions
        ]
        tokenizer = await self.context.tokenizers.get(model) if maybe else None
        if tokenizer is None:
            return
        room = positions - tokenizer.pair_special_tokens
        names = pair_names(*sides)
        for index in maybe:
            a, b = pairs[index]
            if await by_length([a, b], pair_past, tokenizer, a, b, room):
                raise UnprocessableInput(
                    f"{names[index]}: the pair is more than {positions} tokens with the "
                    f"special tokens around it, and {SAYS.format(limit=positions)}",
                    param=second,
                )


def names_of(field: str, texts: list[str]) -> list[str]:
    """What a refusal calls each text of `field`."""
    return [item_name(f'"{field}"', index, len(texts)) for index in range(len(texts))]


def pair_names(*sides: tuple[str, list[str]]) -> list[str]:
    """What a refusal calls each pair of /score's two sides (one text against a list, or
    two lists pairwise)."""
    (first, firsts), (second, seconds) = sides
    if len(firsts) == 1:
        return [f'the pair of "{first}" and {name}' for name in names_of(second, seconds)]
    return [f'the pair of "{first}" and "{second}" at index {i}' for i in range(len(seconds))]


def broadcast(firsts: list[str], seconds: list[str]) -> list[str]:
    """The first side as long as the second: its one text against each of a list."""
    return firsts * len(seconds) if len(firsts) == 1 else firsts


def pair_past(tokenizer: ServerTokenizer, first: str, second: str, room: int) -> bool:
    """Whether two texts take more than `room` tokens together, counted no further."""
    taken = tokenizer.count_past(first, room)
    return taken > room or tokenizer.count_past(second, room - taken) > room - taken


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

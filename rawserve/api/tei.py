"""Text Embeddings Inference's routes, in TEI's request and response shapes:
`/embed`, `/embed_all` (feature-extraction), `/predict` (text-classification), `/rerank`
(a cross-encoder: text-classification with one label), `/tokenize` and `/decode` (any
model with a tokenizer), and TEI's fields for `/info`.

Embeddings and scores are computed by the workers, batched with every other request;
`/predict` and `/rerank` ask them for logits and make scores, labels and the order here.
Tokenizing and decoding run in this process (`tokens.ServerTokenizer`). A route that does
not fit the model is 404 saying what it needs. Never imports torch.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import numpy as np

from rawserve import __version__
from rawserve.api import schemas
from rawserve.api.bodies import answer, check_client_batch, json_response, read_json
from rawserve.api.context import RouteContext
from rawserve.api.fields import Fields, unicode_text
from rawserve.api.outcomes import unwrap
from rawserve.api.routing import (
    MODEL_ERRORS,
    Handler,
    Needs,
    Operation,
    Route,
    Schema,
    SchemaOf,
)
from rawserve.api.served import ServedModel
from rawserve.api.tokens import ServerTokenizer, UnknownTokenId
from rawserve.http.errors import BadRequest, UnprocessableInput
from rawserve.http.exchange import HttpRequest, HttpResponse
from rawserve.serving.face import EMBEDDING_ROUTE
from rawserve.tasks import LOGITS_PARAM

EMBEDDING = Needs(frozenset({"feature-extraction"}), "a feature-extraction model")
CLASSIFIER = Needs(frozenset({"text-classification"}), "a text-classification model")
CROSS_ENCODER = Needs(
    frozenset({"text-classification"}),
    "a text-classification model with one label (a cross-encoder)",
    labels=1,
)
TOKENIZER = Needs(tokenizer=True, what="a model with a tokenizer")

DIRECTIONS = ("left", "right", "Left", "Right")  # TEI takes both spellings
TRUNCATION = ("truncate", "truncation_direction")
EMBED_FIELDS = ("inputs", "normalize", "prompt_name", "dimensions", "model", *TRUNCATION)
EMBED_ALL_FIELDS = ("inputs", "prompt_name", "model", *TRUNCATION)
PREDICT_FIELDS = ("inputs", "raw_scores", "model", *TRUNCATION)
RERANK_FIELDS = ("query", "texts", "raw_scores", "return_text", "model", *TRUNCATION)
TOKENIZE_FIELDS = ("inputs", "add_special_tokens", "prompt_name", "model")
DECODE_FIELDS = ("ids", "skip_special_tokens", "model")
MAX_TOKEN_ID = 2**32 - 1
TAG = "Text Embeddings Inference"
TOKENIZER_ERRORS = (400, 404, 413, 422, 503)


class TeiRoutes:
    def __init__(self, context: RouteContext):
        self.context = context
        self.settings = context.settings
        self._tokenizers: dict[str, ServerTokenizer] = {}  # by model name, built on first use

    def routes(self) -> list[Route]:
        def post(path: str, handler: Handler, needs: Needs, operation: Operation) -> Route:
            # /tokenize and /decode run in the server: only the others queue model work
            return Route("POST", path, handler, operation, needs, queued=needs is not TOKENIZER)

        def described(summary: str, request: SchemaOf, answer: Schema) -> Operation:
            return Operation(
                f"{summary} (TEI)", TAG, request, lambda _: answer, errors=MODEL_ERRORS
            )

        return [
            post("/embed", self.embed, EMBEDDING, described(
                "Sentence embeddings", schemas.tei_embed_request, schemas.TEI_EMBED_RESPONSE)),
            post("/embed_all", self.embed_all, EMBEDDING, described(
                "Token embeddings, unpooled", schemas.tei_embed_all_request,
                schemas.TEI_EMBED_ALL_RESPONSE)),
            post("/predict", self.predict, CLASSIFIER, described(
                "Every label's score", schemas.tei_predict_request, schemas.TEI_PREDICT_RESPONSE)),
            post("/rerank", self.rerank, CROSS_ENCODER, described(
                "Texts ranked by relevance to a query", schemas.tei_rerank_request,
                schemas.TEI_RERANK_RESPONSE)),
            post("/tokenize", self.tokenize, TOKENIZER, replace(described(
                "Tokens and their offsets", schemas.tei_tokenize_request,
                schemas.TEI_TOKENIZE_RESPONSE), errors=TOKENIZER_ERRORS)),
            post("/decode", self.decode, TOKENIZER, replace(described(
                "Token ids to text", schemas.tei_decode_request, schemas.TEI_DECODE_RESPONSE),
                errors=TOKENIZER_ERRORS)),
        ]  # fmt: skip

    # --- embeddings -------------------------------------------------------------------

    async def embed(self, request: HttpRequest) -> HttpResponse:
        """A pooled sentence vector per input (normalized unless `normalize: false`)."""
        fields = Fields(read_json(request), EMBED_FIELDS)
        model = self.context.model_for(fields.get("model"), EMBEDDING)
        texts = self.texts(fields, model)
        params: dict[str, Any] = {
            "normalize": fields.boolean("normalize", True),
            **truncation(fields),
        }
        dimensions = fields.integer("dimensions", 1, 65536)
        if dimensions is not None:
            params["dimensions"] = dimensions
        results = await model.run(texts, params, self.context.deadline(request), EMBEDDING_ROUTE)
        return answer([unwrap(result)["embedding"] for result in results], results)

    async def embed_all(self, request: HttpRequest) -> HttpResponse:
        """Every token's vector, unpooled, per input."""
        fields = Fields(read_json(request), EMBED_ALL_FIELDS)
        model = self.context.model_for(fields.get("model"), EMBEDDING)
        texts = self.texts(fields, model)
        params = {"pooling": "none", "normalize": False, **truncation(fields)}
        results = await model.run(texts, params, self.context.deadline(request))
        # the worker answers the pipeline's [1, tokens, hidden] per input
        return answer([unwrap(result)[0] for result in results], results)

    def texts(self, fields: Fields, model: ServedModel) -> list[str]:
        """The texts of `inputs` (one or a list), with the named prompt put before each."""
        texts = text_inputs(fields.get("inputs"), self.settings.max_client_batch_size)
        prompt_name = fields.string("prompt_name")
        if prompt_name is None:
            return texts
        prompt = prompts_of(model).get(prompt_name)
        if prompt is None:
            known = ", ".join(sorted(prompts_of(model))) or "it names none"
            raise BadRequest(
                f"prompt_name {prompt_name[:100]!r} is not a prompt of this model ({known})"
            )
        return [prompt + text for text in texts]

    # --- classification ---------------------------------------------------------------

    async def predict(self, request: HttpRequest) -> HttpResponse:
        """Every label's score per input (a text or a pair), best first."""
        fields = Fields(read_json(request), PREDICT_FIELDS)
        model = self.context.model_for(fields.get("model"), CLASSIFIER)
        items, is_batch = predict_inputs(fields.get("inputs"))
        check_client_batch(len(items), self.settings.max_client_batch_size)
        raw_scores = fields.boolean("raw_scores", False)
        params = {LOGITS_PARAM: True, **truncation(fields)}
        results = await model.run(items, params, self.context.deadline(request))
        labels = labels_of(model)
        predictions = [
            predictions_from(scores(unwrap(result), raw_scores), labels) for result in results
        ]
        return answer(predictions if is_batch else predictions[0], results)

    async def rerank(self, request: HttpRequest) -> HttpResponse:
        """Each text's relevance to the query, most relevant first."""
        fields = Fields(read_json(request), RERANK_FIELDS)
        model = self.context.model_for(fields.get("model"), CROSS_ENCODER)
        query = fields.required("query")
        if not isinstance(query, str):
            raise BadRequest('"query" must be a string')
        texts = fields.required("texts")
        if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
            raise BadRequest('"texts" must be a non-empty list of strings')
        check_client_batch(len(texts), self.settings.max_client_batch_size)
        unicode_text(query, '"query"')
        for text in texts:
            unicode_text(text, '"texts"')
        raw_scores = fields.boolean("raw_scores", False)
        return_text = fields.boolean("return_text", False)
        pairs = [{"text": query, "text_pair": text} for text in texts]
        params = {LOGITS_PARAM: True, **truncation(fields)}
        results = await model.run(pairs, params, self.context.deadline(request))
        ranks = []
        for index, result in enumerate(results):
            rank: dict[str, Any] = {
                "index": index,
                "score": float(scores(unwrap(result), raw_scores)[0]),
            }
            if return_text:
                rank["text"] = texts[index]
            ranks.append(rank)
        ranks.sort(key=lambda rank: rank["score"], reverse=True)
        return answer(ranks, results)

    # --- the tokenizer ----------------------------------------------------------------

    async def tokenize(self, request: HttpRequest) -> HttpResponse:
        """Each input's tokens: id, text, whether special, and byte offsets."""
        fields = Fields(read_json(request), TOKENIZE_FIELDS)
        model = self.context.model_for(fields.get("model"), TOKENIZER)
        texts = self.texts(fields, model)
        tokenizer = await self.tokenizer(model)
        body = await tokenizer.tokenize(texts, fields.boolean("add_special_tokens", True))
        return HttpResponse(200, body)

    async def decode(self, request: HttpRequest) -> HttpResponse:
        """The text of each list of ids."""
        fields = Fields(read_json(request), DECODE_FIELDS)
        model = self.context.model_for(fields.get("model"), TOKENIZER)
        id_lists = id_inputs(fields.get("ids"), self.settings.max_client_batch_size)
        tokenizer = await self.tokenizer(model)
        try:
            texts = await tokenizer.decode(id_lists, fields.boolean("skip_special_tokens", True))
        except UnknownTokenId as exc:
            raise UnprocessableInput(str(exc)) from None
        return json_response(200, texts)

    async def tokenizer(self, model: ServedModel) -> ServerTokenizer:
        """The model's tokenizer in this process, loaded (off the event loop) once."""
        tokenizer = self._tokenizers.get(model.name)
        if tokenizer is None:
            loaded = model.serving.loaded
            assert loaded is not None and loaded.tokenizer is not None  # TOKENIZER checked it
            tokenizer = await asyncio.to_thread(ServerTokenizer, loaded.tokenizer)
            self._tokenizers[model.name] = tokenizer
        return tokenizer


# --- request parts ----------------------------------------------------------------------


def truncation(fields: Fields) -> dict[str, Any]:
    """The worker parameters of TEI's `truncate` (default false: too long is 422) and
    `truncation_direction`."""
    return {
        "truncate": fields.boolean("truncate", False),
        "truncation_direction": fields.choice("truncation_direction", DIRECTIONS, "right").lower(),
    }


def text_inputs(value: Any, max_inputs: int) -> list[str]:
    """`inputs` as a list of texts: one text, or a non-empty list of them."""
    texts = [value] if isinstance(value, str) else value
    if not isinstance(texts, list) or not texts:
        raise BadRequest('"inputs" must be a text or a non-empty list of texts')
    if not all(isinstance(text, str) for text in texts):
        if all(isinstance(item, (int, list)) for item in texts):
            raise BadRequest('"inputs" as token ids is not supported: send the text')
        raise BadRequest('"inputs" must be a text or a non-empty list of texts')
    check_client_batch(len(texts), max_inputs)
    return [unicode_text(text, '"inputs"') for text in texts]


def predict_inputs(value: Any) -> tuple[list[Any], bool]:
    """TEI's /predict inputs: a text, a pair `[text, text]`, or a batch of `[text]` and
    `[text, text]`; the items to classify, and whether it was a batch."""
    refusal = BadRequest(
        '"inputs" must be a text, a pair [text, text], or a list of [text] and [text, text]'
    )
    if isinstance(value, str):
        return [unicode_text(value, '"inputs"')], False
    if not isinstance(value, list) or not value:
        raise refusal
    if all(isinstance(item, str) for item in value):
        if len(value) > 2:
            raise refusal
        return [sequence(value)], False
    if not all(isinstance(item, list) and 1 <= len(item) <= 2 for item in value):
        raise refusal
    if not all(isinstance(text, str) for item in value for text in item):
        raise refusal
    return [sequence(item) for item in value], True


def sequence(texts: list[str]) -> str | dict[str, str]:
    """One text, or a pair as the classifier takes it."""
    for text in texts:
        unicode_text(text, '"inputs"')
    if len(texts) == 1:
        return texts[0]
    return {"text": texts[0], "text_pair": texts[1]}


def id_inputs(value: Any, max_lists: int) -> list[list[int]]:
    """`ids`: one list of token ids, or a non-empty list of them."""
    refusal = BadRequest('"ids" must be a list of token ids, or a non-empty list of such lists')
    if not isinstance(value, list) or not value:
        raise refusal
    lists = value if all(isinstance(item, list) for item in value) else [value]
    check_client_batch(len(lists), max_lists)
    for ids in lists:
        if not ids or not all(
            isinstance(i, int) and not isinstance(i, bool) and 0 <= i <= MAX_TOKEN_ID for i in ids
        ):
            raise refusal
    return lists


# --- answer parts -----------------------------------------------------------------------


def scores(logits: Any, raw: bool) -> np.ndarray:
    """Scores from one input's logits: as they are, or a softmax (a sigmoid for one label),
    as TEI makes them."""
    row = np.asarray(logits, dtype=np.float64)
    if not np.all(np.isfinite(row)):
        raise UnprocessableInput("the model's scores for this input are not numbers")
    if raw:
        return row
    if row.size == 1:
        return np.asarray(1 / (1 + np.exp(-row)))
    exp = np.exp(row - row.max())
    return np.asarray(exp / exp.sum())


def predictions_from(row: np.ndarray, labels: Mapping[str, str]) -> list[dict[str, Any]]:
    ranked = sorted(range(row.size), key=lambda i: row[i], reverse=True)
    return [{"label": labels.get(str(i), f"LABEL_{i}"), "score": float(row[i])} for i in ranked]


def labels_of(model: ServedModel) -> Mapping[str, str]:
    loaded = model.serving.loaded
    return loaded.details.get("id2label", {}) if loaded else {}


def prompts_of(model: ServedModel) -> Mapping[str, str]:
    loaded = model.serving.loaded
    return loaded.details.get("prompts", {}) if loaded else {}


# --- /info ------------------------------------------------------------------------------


def tei_info(model: ServedModel, max_client_batch_size: int) -> dict[str, Any]:
    """TEI's /info fields for `model`, beside rawserve's own."""
    loaded = model.serving.loaded
    details: Mapping[str, Any] = loaded.details if loaded else {}
    facts = model.facts
    batching = facts.get("batching", {})
    max_input_length = int(details.get("max_input_length") or 0)
    max_batch_size = int(batching.get("max_batch_size") or 0)
    info: dict[str, Any] = {
        "model_id": facts.get("model") or facts.get("handler") or model.name,
        "model_sha": None,
        "model_dtype": loaded.dtype if loaded else None,
        "served_model_name": model.name,
        "max_concurrent_requests": batching.get("max_queue"),
        "max_input_length": max_input_length,
        # TEI's budget of a batch; without --max-batch-tokens, what the batch size allows
        "max_batch_tokens": batching.get("max_batch_tokens") or max_batch_size * max_input_length,
        "max_batch_requests": max_batch_size,
        "max_client_batch_size": max_client_batch_size,
        "auto_truncate": False,
        "tokenization_workers": len(model.serving.snapshot().workers),
        "version": __version__,
        "sha": None,
        "docker_label": None,
    }
    model_type = tei_model_type(loaded.task if loaded else None, details)
    if model_type is not None:
        info["model_type"] = model_type
    return info


def tei_model_type(task: str | None, details: Mapping[str, Any]) -> dict[str, Any] | None:
    """TEI's ModelType: embedding (its pooling), classifier or reranker (its labels)."""
    if task == "feature-extraction":
        pooling = details.get("pooling")
        return {"embedding": {"pooling": "mean" if pooling in (None, "none") else pooling}}
    if task == "text-classification":
        id2label = dict(details.get("id2label", {}))
        labels = {"id2label": id2label, "label2id": {v: int(k) for k, v in id2label.items()}}
        return {"reranker" if len(id2label) == 1 else "classifier": labels}
    return None

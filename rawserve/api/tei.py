"""Text Embeddings Inference's routes, in TEI's request and response shapes:
`/embed`, `/embed_all` (feature-extraction), `/predict` (text-classification), `/rerank`
(a cross-encoder: text-classification with one label), `/tokenize` and `/decode` (any
model with a tokenizer), and TEI's fields for `/info`. The same cross-encoders also rank
in the shape of Cohere's, Jina's and vLLM's rerank (`/v1/rerank`, `/v2/rerank`, and
`/rerank` where a body has `documents`), which litellm's rerank providers post.

Embeddings and scores are computed by the workers, batched with every other request;
`/predict` and `/rerank` ask them for logits and make scores, labels and the order here.
Tokenizing and decoding run in this process (`tokens.ServerTokenizer`). A route that does
not fit the model is 404 saying what it needs.

As TEI does, the routes ignore fields they do not use (its clients send some that only
some servers read: tei-client's `normalize` on `/embed_all`, litellm's `top_n` on
`/rerank`). What one request may cost is bounded: a `/tokenize` input at most the
model's input length, or 32,768 tokens where it is the request's only one (422;
`truncate: true` cuts it to the model's input length), and an answer at most
`max_answer_bytes` (413, checked before the work where the token counts tell). Never
imports torch.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from rawserve import __version__
from rawserve.api import chat_tokens, schemas, vllm_tokens
from rawserve.api.bodies import answer, built_answer, read_json, vector_entries
from rawserve.api.context import RouteContext
from rawserve.api.fields import Body, Fields, names_after
from rawserve.api.outcomes import unwrap_all
from rawserve.api.prompt_cuts import asked_cut
from rawserve.api.prompts import check_input_lengths
from rawserve.api.routing import (
    DENSE_EMBEDDING,
    MODEL_ERRORS,
    DocContext,
    Handler,
    Needs,
    Operation,
    Route,
    Schema,
)
from rawserve.api.sentence_prompts import prompted
from rawserve.api.served import ServedModel
from rawserve.api.tei_bodies import (
    DECODE,
    EMBED,
    EMBED_ALL,
    EMBED_SPARSE,
    PREDICT,
    RERANK,
    RERANK_DOCUMENTS,
    SIMILARITY,
    TOKENIZE,
    checked_text,
    checked_texts,
    rank_count,
    truncation,
)
from rawserve.api.tokens import (
    AnswerTooLarge,
    ServerTokenizer,
    TokenBound,
    TooManyTokens,
    UnknownTokenId,
    answer_within,
)
from rawserve.http.errors import BadRequest, InternalError, PayloadTooLarge, UnprocessableInput
from rawserve.http.exchange import HttpRequest, HttpResponse
from rawserve.serving.face import EMBEDDING_ROUTE, SPARSE_ROUTE, ItemResult
from rawserve.tasks import LOGITS_PARAM

EMBEDDING = Needs(frozenset({"feature-extraction"}), "a feature-extraction model")
# a SPLADE model's sparse vectors (and DENSE_EMBEDDING: the routes they have no meaning on)
SPARSE_EMBEDDING = Needs(
    EMBEDDING.tasks, "a feature-extraction model with SPLADE pooling", sparse=True
)
CLASSIFIER = Needs(frozenset({"text-classification"}), "a text-classification model")
CROSS_ENCODER = Needs(
    frozenset({"text-classification"}),
    "a text-classification model with one label (a cross-encoder)",
    labels=1,
)
TOKENIZER = Needs(tokenizer=True, what="a model with a tokenizer", worker=False)

# An input's tokens when the model names no input length or a larger one.
MAX_TOKENIZE_TOKENS = 131072
# The most tokens /tokenize lists of a request's one input past the model's length
# (special tokens included): about 2 MB of answer, 17 MB of the server's memory meanwhile
MAX_LISTED_TOKENS = 32768
# Bytes a number of an /embed_all answer takes as JSON, about (`-0.012345678,`).
NUMBER_BYTES = 12
TAG = "Text Embeddings Inference"
TOKENIZER_ERRORS = (400, 404, 413, 415, 422, 503)
# TEI's names of sentence-transformers' pooling modes, where they differ (TEI has none for
# max, weightedmean and mean_sqrt_len_tokens: /info says sentence-transformers' own)
TEI_POOLING_NAMES = {"lasttoken": "last_token"}
INLINE_COUNT = 4096  # characters counted on the event loop; more: in a thread
# the rerank of Cohere (`/v2/rerank`, litellm's `cohere/`), Jina and vLLM (`/v1/rerank`;
# `/rerank` takes it too, where a body has `documents`)
RERANK_DOCUMENTS_PATHS = ("/v1/rerank", "/v2/rerank")


class TeiRoutes:
    def __init__(self, context: RouteContext):
        self.context = context
        self.settings = context.settings

    def routes(self) -> list[Route]:
        def post(path: str, handler: Handler, needs: Needs, operation: Operation) -> Route:
            # /tokenize and /decode run in the server: only the others queue model work
            return Route("POST", path, handler, operation, needs, queued=needs is not TOKENIZER)

        def described(summary: str, request: Body, answer: Schema) -> Operation:
            return Operation(
                f"{summary} (TEI)", TAG, request.schema, lambda _: answer, errors=MODEL_ERRORS
            )

        return [
            post("/embed", self.embed, EMBEDDING, described(
                "Sentence embeddings", EMBED, schemas.TEI_EMBED_RESPONSE)),
            post("/embed_all", self.embed_all, DENSE_EMBEDDING, described(
                "Token embeddings, unpooled", EMBED_ALL, schemas.TEI_EMBED_ALL_RESPONSE)),
            post("/embed_sparse", self.embed_sparse, SPARSE_EMBEDDING, described(
                "Sparse embeddings: each word's weight, where not zero (SPLADE)", EMBED_SPARSE,
                schemas.TEI_EMBED_SPARSE_RESPONSE)),
            post("/similarity", self.similarity, DENSE_EMBEDDING, described(
                "Sentence similarity", SIMILARITY, schemas.TEI_SIMILARITY_RESPONSE)),
            post("/predict", self.predict, CLASSIFIER, described(
                "Every label's score", PREDICT, schemas.TEI_PREDICT_RESPONSE)),
            post("/rerank", self.rerank, CROSS_ENCODER, described(
                "Texts ranked by relevance to a query", RERANK, schemas.TEI_RERANK_RESPONSE)),
            *(
                post(path, self.rerank_documents, CROSS_ENCODER, Operation(
                    "Documents ranked by relevance to a query (Cohere, Jina, vLLM)",
                    TAG,
                    RERANK_DOCUMENTS.schema,
                    lambda _: schemas.RERANK_DOCUMENTS_RESPONSE,
                    errors=MODEL_ERRORS,
                ))
                for path in RERANK_DOCUMENTS_PATHS
            ),
            post("/tokenize", self.tokenize, TOKENIZER, Operation(
                "Tokens and their offsets (TEI), or a prompt's ids (vLLM: a body with "
                "`prompt`, or a chat's with `messages`)", TAG,
                lambda context: {"anyOf": [
                    TOKENIZE.schema(context), vllm_tokens.TOKENIZE.schema(context),
                    chat_tokens.TOKENIZE_CHAT.schema(context)]},
                lambda _: {"anyOf": [
                    schemas.TEI_TOKENIZE_RESPONSE, vllm_tokens.TOKENIZE_RESPONSE]},
                errors=(*TOKENIZER_ERRORS, 504))),
            post("/decode", self.decode, TOKENIZER, replace(described(
                "Token ids to text", DECODE, schemas.TEI_DECODE_RESPONSE),
                errors=TOKENIZER_ERRORS)),
            post("/detokenize", self.detokenize, TOKENIZER, Operation(
                "Token ids to text (vLLM)", TAG, vllm_tokens.DETOKENIZE.schema,
                lambda _: vllm_tokens.DETOKENIZE_RESPONSE, errors=TOKENIZER_ERRORS)),
        ]  # fmt: skip

    def within(self, model: ServedModel) -> DocContext:
        """What a body's fields are read against: the model, and the input cap."""
        return DocContext(model, self.settings.max_client_batch_size)

    # --- embeddings -------------------------------------------------------------------

    async def embed(self, request: HttpRequest) -> HttpResponse:
        """A pooled sentence vector per input (normalized unless `normalize: false`)."""
        fields = EMBED.read(read_json(request))
        # a body naming no model, asking normalized vectors, among several models: one of
        # dense vectors (a SPLADE model's are refused normalized; alone, it says so)
        several = len(self.context.models.all) > 1 and fields.get("model") is None
        needs = DENSE_EMBEDDING if several and fields.value("normalize") else EMBEDDING
        model = self.context.model_for(fields.get("model"), needs, queued_for=request)
        inputs = await self.inputs(fields, model)
        await self.refuse_too_long(model, inputs, fields)
        params: dict[str, Any] = {
            "normalize": fields.value("normalize"),
            **truncation(fields),
        }
        dimensions = fields.value("dimensions")
        if dimensions is not None:
            params["dimensions"] = dimensions
        results = await model.run(inputs, params, self.context.deadline(request), EMBEDDING_ROUTE)
        return answer([output["embedding"] for output in unwrap_all(results)], results)

    async def embed_all(self, request: HttpRequest) -> HttpResponse:
        """Every token's vector, unpooled, per input."""
        fields = EMBED_ALL.read(read_json(request))
        model = self.context.model_for(fields.get("model"), DENSE_EMBEDDING, queued_for=request)
        inputs = await self.inputs(fields, model)
        await self.refuse_too_long(model, inputs, fields)
        params = {"pooling": "none", "normalize": False, **truncation(fields)}
        await self.check_embed_all_size(model, inputs)
        results = await model.run(inputs, params, self.context.deadline(request))
        # the worker answers the pipeline's [1, tokens, hidden] per input
        vectors = [output[0] for output in unwrap_all(results)]
        # the exact count, for a model whose sizes were not known before the work
        check_answer_size(sum(int(np.size(v)) for v in vectors), self.settings.max_answer_bytes)
        return await built_answer(lambda: vectors, results, vector_entries(vectors))

    async def embed_sparse(self, request: HttpRequest) -> HttpResponse:
        """A SPLADE model's vector per input, as its words of nonzero weight."""
        fields = EMBED_SPARSE.read(read_json(request))
        model = self.context.model_for(fields.get("model"), SPARSE_EMBEDDING, queued_for=request)
        inputs = await self.inputs(fields, model)
        await self.refuse_too_long(model, inputs, fields)
        # (normalized only where the folder normalizes: the worker's default here)
        params = truncation(fields)
        results = await model.run(inputs, params, self.context.deadline(request), SPARSE_ROUTE)
        outputs = unwrap_all(results)
        weights = [output["values"] for output in outputs]
        # an index and a weight a word: counted as two numbers
        check_answer_size(2 * sum(len(w) for w in weights), self.settings.max_answer_bytes)

        def listed() -> list[list[dict[str, Any]]]:
            return [
                [
                    {"index": index, "value": weight}
                    for index, weight in zip(out["indices"].tolist(), out["values"], strict=True)
                ]
                for out in outputs
            ]

        return await built_answer(listed, results, 2 * vector_entries(weights))

    async def check_embed_all_size(
        self, model: ServedModel, inputs: Sequence[str | list[int]]
    ) -> None:
        """413 before the work when the token vectors of `inputs` would make an answer over
        the bound: texts counted with the server's tokenizer when the worst case is over it,
        token ids as they are."""
        loaded = model.serving.loaded
        dimensions = int(loaded.details.get("token_dimensions") or 0) if loaded else 0
        limit = input_limit(model)
        largest = self.settings.max_answer_bytes
        if loaded is None or loaded.tokenizer is None or not dimensions:
            return
        if len(inputs) * limit * dimensions * NUMBER_BYTES <= largest:
            return  # even inputs of the model's whole length fit
        texts = [one for one in inputs if isinstance(one, str)]
        counts = [min(len(one), limit) for one in inputs if isinstance(one, list)]
        if texts:
            tokenizer = await self.tokenizer(model)
            if sum(len(text) for text in texts) <= INLINE_COUNT:
                counts += tokenizer.count(texts, limit)
            else:
                counts += await asyncio.to_thread(tokenizer.count, texts, limit)
        check_answer_size(sum(counts) * dimensions, largest)

    async def refuse_too_long(
        self,
        model: ServedModel,
        inputs: Sequence[Any],
        fields: Fields,
        names: Sequence[str] | None = None,
    ) -> None:
        """422 before the work for a text longer than the model takes, unless `truncate`
        (`check_input_lengths`: the worker tokenized it whole first, and again as its
        batch was split to find it)."""
        if not fields.value("truncate"):
            says = "the model takes at most {limit}: send truncate: true to cut it"
            await check_input_lengths(self.context.tokenizers, model, inputs, says, names)

    async def similarity(self, request: HttpRequest) -> HttpResponse:
        """Each sentence's cosine similarity to the source sentence."""
        fields = SIMILARITY.read(read_json(request))
        model = self.context.model_for(fields.get("model"), DENSE_EMBEDDING, queued_for=request)
        return await sentence_similarity(self.context, model, fields, request)

    async def inputs(self, fields: Fields, model: ServedModel) -> list[str | list[int]]:
        """The inputs of /embed and /embed_all: texts with their prompt, as `texts` gives
        them, and token ids as they are; with `prompt_name`, as TEI reads them, the ids
        decoded (without their special tokens) and put after the prompt as a text."""
        inputs = fields.value("inputs", self.within(model))
        prompt_name = fields.value("prompt_name")
        id_lists = [one for one in inputs if isinstance(one, list)]
        if prompt_name is not None and id_lists:
            prompted(model, [], prompt_name)  # (a name the model has not: 400 first)
            decoded = iter(await self.decoded(model, id_lists))
            texts = [one if isinstance(one, str) else next(decoded) for one in inputs]
            return [*prompted(model, texts, prompt_name)]
        given = [one for one in inputs if isinstance(one, str)]
        with_prompt = iter(prompted(model, given, prompt_name))
        return [next(with_prompt) if isinstance(one, str) else one for one in inputs]

    async def decoded(self, model: ServedModel, id_lists: list[list[int]]) -> list[str]:
        """The texts of token ids that a prompt is put before, their special tokens left
        out (the text is encoded again, with them)."""
        tokenizer = await self.context.tokenizers.get(model)
        if tokenizer is None:
            raise BadRequest(
                '"prompt_name" with token ids needs the model\'s tokenizer in the server, and '
                "this model's has no `tokenizers` form: send the inputs as text"
            )
        try:
            return await tokenizer.decode(id_lists, skip_special=True)
        except UnknownTokenId as exc:
            raise UnprocessableInput(str(exc)) from None

    def texts(self, fields: Fields, model: ServedModel) -> list[str]:
        """The texts of `inputs` (one or a list), with the named prompt (or the model's
        default one) put before each."""
        texts = fields.value("inputs", self.within(model))
        return prompted(model, texts, fields.value("prompt_name"))

    # --- classification ---------------------------------------------------------------

    async def predict(self, request: HttpRequest) -> HttpResponse:
        """Every label's score per input (a text or a pair), best first."""
        fields = PREDICT.read(read_json(request))
        model = self.context.model_for(fields.get("model"), CLASSIFIER, queued_for=request)
        items, is_batch = fields.value("inputs", self.within(model))
        await self.refuse_too_long(model, items, fields)
        raw_scores = fields.value("raw_scores")
        params = {LOGITS_PARAM: True, **truncation(fields)}
        results = await model.run(items, params, self.context.deadline(request))
        labels = labels_of(model)
        predictions = [
            predictions_from(scores(output["logits"], raw_scores), labels)
            for output in unwrap_all(results)
        ]
        return answer(predictions if is_batch else predictions[0], results)

    async def rerank(self, request: HttpRequest) -> HttpResponse:
        """Each text's relevance to the query, most relevant first. A body with
        `documents` instead of `texts` is the rerank of Cohere, Jina and vLLM, answered
        in their shape, as vLLM and Infinity serve it on this path."""
        document = read_json(request)
        if isinstance(document, dict) and "documents" in document and "texts" not in document:
            return await self.documents_ranked(request, document)
        fields = RERANK.read(document)
        model = self.context.model_for(fields.get("model"), CROSS_ENCODER, queued_for=request)
        texts = fields.value("texts", self.within(model))
        raw_scores = fields.value("raw_scores")
        return_text = fields.value("return_text")
        best = rank_count(fields, len(texts))
        relevance, results = await self.relevance(
            request, model, fields, (texts, '"texts"'), raw_scores
        )
        ranks = []
        for index, score in enumerate(relevance):
            rank: dict[str, Any] = {"index": index, "score": score}
            if return_text:
                rank["text"] = texts[index]
            ranks.append(rank)
        ranks.sort(key=lambda rank: rank["score"], reverse=True)
        return answer(ranks[:best], results)

    async def rerank_documents(self, request: HttpRequest) -> HttpResponse:
        """`/v1/rerank` and `/v2/rerank`: the rerank of Cohere, Jina and vLLM."""
        return await self.documents_ranked(request, read_json(request))

    async def documents_ranked(self, request: HttpRequest, document: Any) -> HttpResponse:
        """`documents` ranked by relevance to `query` (sigmoid scores, as TEI's), answered
        as vLLM and Jina answer (`results`, each its `index`, `relevance_score` and
        `document`), which litellm's and Cohere's clients read too."""
        fields = RERANK_DOCUMENTS.read(document)
        model = self.context.model_for(fields.get("model"), CROSS_ENCODER, queued_for=request)
        texts = fields.value("documents", self.within(model))
        cut = asked_cut(model, fields)  # vLLM's, where asked: else TEI's `truncate`
        relevance, results = await self.relevance(
            request, model, fields, (texts, '"documents"'), cut=cut
        )
        order = sorted(range(len(texts)), key=lambda index: relevance[index], reverse=True)
        ranked = []
        for index in order[: fields.value("top_n") or len(texts)]:
            result: dict[str, Any] = {"index": index, "relevance_score": relevance[index]}
            if fields.value("return_documents"):
                result["document"] = {"text": texts[index]}
            ranked.append(result)
        tokens = sum(output["tokens"] for output in unwrap_all(results))
        body = {
            "id": f"rerank-{uuid.uuid4().hex}",
            "model": model.name,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},  # (vLLM's, Jina's)
            "results": ranked,
        }
        return answer(body, results)

    async def relevance(
        self,
        request: HttpRequest,
        model: ServedModel,
        fields: Fields,
        named_texts: tuple[list[str], str],
        raw_scores: bool = False,
        cut: Mapping[str, Any] | None = None,
    ) -> tuple[list[float], list[ItemResult]]:
        """Each text's score against the body's query, in the texts' order, and the
        results they came from (`named_texts`: the texts, and their field's name; `cut`:
        the worker's parameters of a cut asked otherwise than by `truncate`)."""
        query = checked_text(fields.value("query"), '"query"')
        texts, name = named_texts
        checked_texts(texts, name)
        names = names_after('"query"', name, len(texts))
        if cut is None:
            await self.refuse_too_long(model, [query, *texts], fields, names)
        pairs = [{"text": query, "text_pair": text} for text in texts]
        params = {LOGITS_PARAM: True, **(cut or truncation(fields))}
        results = await model.run(pairs, params, self.context.deadline(request))
        outputs = unwrap_all(results)
        return [float(scores(output["logits"], raw_scores)[0]) for output in outputs], results

    # --- the tokenizer ----------------------------------------------------------------

    async def tokenize(self, request: HttpRequest) -> HttpResponse:
        """Each input's tokens: id, text, whether special, and byte offsets (TEI's); or a
        prompt's ids (vLLM's body: `vllm_tokens`)."""
        document = read_json(request)
        if vllm_tokens.is_vllms(document):
            if document.get("messages") is not None:
                return await chat_tokens.vllm_chat_tokenized(
                    self.context, request, document, model_length
                )
            return await self.vllm_tokenize(document)
        fields = TOKENIZE.read(document)
        model = self.context.model_for(fields.get("model"), TOKENIZER)
        texts = self.texts(fields, model)
        cut = truncation(fields)
        # As TEI's: one text longer than the model takes is listed whole (a client counts a
        # document's tokens to know where to cut it), unless asked to cut it as the model
        # would; of a list, each at most the model's length (16 texts of 30,000 tokens took
        # 6 s and 250 MB of the server's memory)
        of_a_list = input_limit(model)
        alone = max(of_a_list, MAX_LISTED_TOKENS)  # one text not cut
        limit = alone if not cut["truncate"] and len(texts) == 1 else of_a_list
        bound = TokenBound(limit, cut["truncate"], cut["truncation_direction"])
        tokenizer = await self.tokenizer(model)
        add_special_tokens = fields.value("add_special_tokens")
        try:
            body = await tokenizer.tokenize(
                texts, add_special_tokens, bound, self.settings.max_answer_bytes
            )
        except TooManyTokens:
            of_one = (
                f" of a list (one text alone: up to {alone:,})"
                if len(texts) > 1 and not cut["truncate"] and alone > of_a_list
                else ""
            )
            raise UnprocessableInput(
                f"an input has more than {bound.max_tokens} tokens, the most /tokenize lists"
                f'{of_one}: send shorter text, or "truncate": true to cut it to what the model '
                "takes"
            ) from None
        except AnswerTooLarge as exc:
            raise PayloadTooLarge(str(exc)) from None
        return HttpResponse(200, body)

    async def decode(self, request: HttpRequest) -> HttpResponse:
        """The text of each list of ids."""
        fields = DECODE.read(read_json(request))
        model = self.context.model_for(fields.get("model"), TOKENIZER)
        id_lists = fields.value("ids", self.within(model))
        tokenizer = await self.tokenizer(model)
        try:
            texts = await tokenizer.decode(id_lists, fields.value("skip_special_tokens"))
        except UnknownTokenId as exc:
            raise UnprocessableInput(str(exc)) from None
        # (bounded as /tokenize's: a larger --max-body-bytes let 32 lists of 250,000 ids
        # make a 48 MB answer)
        return answer_within(texts, self.settings.max_answer_bytes)

    async def vllm_tokenize(self, document: Any) -> HttpResponse:
        """vLLM's /tokenize: a prompt's token ids, and the model's length."""
        fields = vllm_tokens.TOKENIZE.read(document)
        model = self.context.model_for(fields.get("model"), TOKENIZER)
        tokenizer = await self.tokenizer(model)
        largest = self.settings.max_answer_bytes
        return await vllm_tokens.tokenized(tokenizer, fields, model_length(model), largest)

    async def detokenize(self, request: HttpRequest) -> HttpResponse:
        """vLLM's /detokenize: token ids as text."""
        fields = vllm_tokens.DETOKENIZE.read(read_json(request))
        model = self.context.model_for(fields.get("model"), TOKENIZER)
        tokenizer = await self.tokenizer(model)
        return await vllm_tokens.detokenized(tokenizer, fields, self.settings.max_answer_bytes)

    async def tokenizer(self, model: ServedModel) -> ServerTokenizer:
        """The model's tokenizer in this process (the route's TOKENIZER need checked it has one)."""
        tokenizer = await self.context.tokenizers.get(model)
        assert tokenizer is not None
        return tokenizer


# --- request parts ----------------------------------------------------------------------


async def sentence_similarity(
    context: RouteContext, model: ServedModel, fields: Fields, request: HttpRequest
) -> HttpResponse:
    """TEI's /similarity, and the Inference API's sentence-similarity (InferenceClient's
    `sentence_similarity` posts the same body to `POST /`): the cosine of each sentence's
    normalized embedding with the source sentence's."""
    source, sentences = fields.value(
        "inputs", DocContext(model, context.settings.max_client_batch_size)
    )
    options = fields.value("parameters")
    texts = prompted(model, [source, *sentences], options.value("prompt_name"))
    params = {"normalize": True, **truncation(options)}
    results = await model.run(texts, params, context.deadline(request), EMBEDDING_ROUTE)
    names = names_after('"source_sentence"', '"sentences"', len(sentences))
    outputs = unwrap_all(results, names)
    vectors = np.array([output["embedding"] for output in outputs], dtype=np.float64)
    # (unit vectors in float32: a cosine of 1.00000006 failed a client's math.acos)
    return answer([float(score) for score in np.clip(vectors[1:] @ vectors[0], -1, 1)], results)


def model_length(model: ServedModel) -> int:
    """A model's length as vLLM's /tokenize says it (`max_model_len`): its positions, or
    where it names none, what /tokenize lists."""
    return model.positions or input_limit(model)


def input_limit(model: ServedModel) -> int:
    """The most tokens an input of `model` may have (special tokens included)."""
    named = model.positions
    return min(named, MAX_TOKENIZE_TOKENS) if named > 0 else MAX_TOKENIZE_TOKENS


def check_answer_size(numbers: int, largest: int) -> None:
    """413 when `numbers` numbers would make an answer over `largest` bytes."""
    if numbers * NUMBER_BYTES > largest:
        raise PayloadTooLarge(str(AnswerTooLarge(largest)))


# --- answer parts -----------------------------------------------------------------------


def scores(logits: Any, raw: bool) -> np.ndarray:
    """Scores from one input's logits: as they are, or a softmax (a sigmoid for one label),
    as TEI makes them."""
    row = np.asarray(logits, dtype=np.float64)
    if not np.all(np.isfinite(row)):  # the worker fails such an input first: the model's fault
        raise InternalError("the model's scores for this input are not numbers")
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
        "model_sha": facts.get("revision"),  # the Hub commit served (None: a folder)
        "model_dtype": loaded.dtype if loaded else None,
        "served_model_name": model.name,
        "max_concurrent_requests": batching.get("max_queue"),
        "max_input_length": max_input_length,
        # TEI's budget of a batch; without --max-batch-tokens, what the batch size allows
        "max_batch_tokens": batching.get("max_batch_tokens") or max_batch_size * max_input_length,
        "max_batch_requests": max_batch_size,
        "max_client_batch_size": max_client_batch_size,
        "auto_truncate": True,  # `truncate` is true unless a request says false
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
        pooling = "mean" if pooling in (None, "none") else pooling
        return {"embedding": {"pooling": TEI_POOLING_NAMES.get(pooling, pooling)}}
    if task == "text-classification":
        id2label = dict(details.get("id2label", {}))
        labels = {"id2label": id2label, "label2id": {v: int(k) for k, v in id2label.items()}}
        return {"reranker" if len(id2label) == 1 else "classifier": labels}
    return None

"""The OpenAI-compatible routes: `POST /v1/embeddings` (feature-extraction models),
`POST /v1/chat/completions`, `POST /v1/completions` and `POST /v1/responses` (OpenAI's
Responses API, a chat in its shape: `openai_responses`) for text-generation models, and
`GET /v1/models` (and `GET /v1/models/<name>`, one of them by any of its names); the
"model" field picks one of the served models. The generation routes are also served
under each model's own path, `POST /models/<name>/v1/chat/completions` (and so on), as
the Inference API serves them: there the path names the model.

Embeddings: the workers compute pooled, normalized vectors and their real token counts;
they are only reshaped here (base64 is the little-endian float32 bytes of the vector,
encoded by numpy and `base64` in C). Generation goes through the scheduler like any
text-generation request, batched and cancelled when its client leaves; the bodies are
`openai_generation`'s, the answers `openai_answers`'. Never imports torch.
"""

from __future__ import annotations

import base64
import functools
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

from rawserve.api import schemas
from rawserve.api.best_of import likeliest_choices
from rawserve.api.bodies import (
    answer,
    built_answer,
    json_response,
    read_json,
)
from rawserve.api.choices import run_choices
from rawserve.api.context import RouteContext
from rawserve.api.fields import Body, Field, Fields, item_name, text
from rawserve.api.inference import MODELS_PREFIX
from rawserve.api.openai_answers import Answer, Echo
from rawserve.api.openai_generation import (
    CHAT,
    CHAT_GENERATION,
    COMPLETION,
    GENERATION,
    GenerationRequest,
    check_chat_template,
    check_choices,
    check_max_tokens,
    check_token_ids,
    parse_completion,
    parse_model_chat,
    prompt_cut,
    prompt_schema,
    read_prompts,
    refuse_unknown_ids,
)
from rawserve.api.openai_logprobs import listed_entries
from rawserve.api.openai_responses import (
    EVENT_SCHEMA,
    RESPONSE_SCHEMA,
    RESPONSES,
    ResponseAnswer,
    parse_response,
    sampled_with,
)
from rawserve.api.outcomes import unwrap, unwrap_all
from rawserve.api.prompt_cuts import asked_cut, cut_fields
from rawserve.api.prompts import (
    CHAT_LISTED_BYTES,
    CUT_WITH_TRUNCATE_PROMPT_TOKENS,
    LISTED_BYTES,
    UNCUT,
    check_echo_size,
    check_generated_size,
    check_lengths,
    echoed_texts,
    longest_prompt,
)
from rawserve.api.reasoning import answers_opening
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
from rawserve.api.streaming import StreamEnd, TokenStream, event_stream, start_choices
from rawserve.api.tei_bodies import details
from rawserve.api.tokens import ServerTokenizers
from rawserve.api.vllm_pooling import CLASSIFY_PATHS, SCORE_PATHS
from rawserve.http.errors import BadRequest, HTTPError, UnprocessableInput
from rawserve.http.exchange import HttpRequest, HttpResponse
from rawserve.serving.face import EMBEDDING_ROUTE
from rawserve.tasks.checks import BlankInput, visible
from rawserve.tasks.text_generation import (
    CHAT_REFUSALS,
    GRAMMAR_FAILED,
    GRAMMAR_REFUSED,
    MIN_TOKENS_PAST_ROOM,
    THINKING_IN_CONTENT,
    min_tokens_past_room,
    stops_after,
)

TAG = "OpenAI"
OPENAI_PREFIX = "/v1/"  # the OpenAI routes: their errors are OpenAI's error object
# GET /v1/models/<name>: one of the served models, by any name (a Hub id holds a "/")
OPENAI_MODEL_PREFIX = "/v1/models/"
# POST /models/<name> + these: a model's generation routes by its own path, the Inference
# API's (InferenceClient appends them to a model's URL; its body's "model" is that URL)
MODEL_GENERATION_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/responses")
ENCODING_FORMATS = ("float", "base64")
VLLM_PATHS = frozenset((*CLASSIFY_PATHS, *SCORE_PATHS))  # vLLM's routes outside /v1/
# what answers a generation route's body once the model is known: `chat` or `complete`
Answering = Callable[[HttpRequest, ServedModel, Any], Awaitable[HttpResponse]]


def speaks_openai(path: str) -> bool:
    """Whether a path is one of the OpenAI routes, whose errors are OpenAI's object (and
    vLLM's own, which answer errors as its OpenAI routes do)."""
    return (
        path.startswith(OPENAI_PREFIX)
        or path in VLLM_PATHS
        or (path.startswith(MODELS_PREFIX) and path.endswith(MODEL_GENERATION_PATHS))
    )


def read_input(name: str, value: Any, context: DocContext | None) -> list[str | list[int]]:
    """OpenAI's "input": a text, an array of token ids, or a non-empty list of either (one
    form for all), as completions' "prompt"; langchain-openai's `OpenAIEmbeddings` sends
    token arrays unless built with `check_embedding_ctx_length=False`."""
    if value is None:
        raise BadRequest('the JSON body must be an object with an "input" field')
    return read_prompts(name, value, context)


def read_encoding_format(name: str, value: Any, context: DocContext | None) -> str:
    if value not in ENCODING_FORMATS:
        raise BadRequest('"encoding_format" must be "float" or "base64"')
    return str(value)


def read_dimensions(name: str, value: Any, context: DocContext | None) -> int:
    """A vector size from 1 to the model's (refused here, where the error names the field,
    rather than by the worker)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise BadRequest('"dimensions" must be a positive integer')
    most = details(context).get("dimensions") if context is not None else None
    if most is not None and value > most:
        raise UnprocessableInput(f'"dimensions" must be at most {most} for this model')
    return value


def dimensions_schema(context: DocContext) -> Schema:
    """`dimensions` as documented: up to the size of the model's vectors, once known,
    where it alone serves the route."""
    most = None if context.shared else details(context).get("dimensions")
    return {"type": ["integer", "null"], "minimum": 1, **({"maximum": most} if most else {})}


EMBEDDINGS = Body(
    {
        "input": Field(prompt_schema, read_input, reads_null=True, required=True),
        "encoding_format": Field(
            {"enum": [*ENCODING_FORMATS, None]}, read_encoding_format, default="float"
        ),
        "dimensions": Field(dimensions_schema, read_dimensions),
        "user": text(),
        # vLLM's: each input cut to N tokens (where none is asked, to the model's length)
        **cut_fields("cut to the model's length, as sentence-transformers cuts it"),
    }
)


def parse_embeddings_request(
    fields: Fields, context: DocContext
) -> tuple[list[str | list[int]], dict[str, Any], str]:
    """(inputs, worker parameters, encoding format) of an OpenAI embeddings body: an input
    is a text or the model's token ids, read as they are (special tokens included, as
    `/tokenize` gives them; 422 for an id the model has no embedding for)."""
    texts = fields.value("input", context)
    encoding_format = fields.value("encoding_format")
    params: dict[str, Any] = {}
    dimensions = fields.value("dimensions", context)
    if dimensions is not None:
        params["dimensions"] = dimensions
    fields.value("model")
    fields.value("user")
    params.update(asked_cut(context.model, fields, cuts=True) or {})
    for index, one in enumerate(texts):  # as every route: blank text is well-formed, but
        where = item_name('"input"', index, len(texts))  # nothing to embed
        if one == []:
            raise UnprocessableInput(f"a token array of {where} has no ids", param="input")
        try:
            if isinstance(one, str):
                visible(one, f"a text of {where}")
        except BlankInput as exc:
            raise UnprocessableInput(str(exc), param="input") from None
    refuse_unknown_ids(texts, details(context).get("vocabulary"), "input")
    return texts, params, encoding_format


def named(document: Any) -> Any:
    """The "model" field of a body (None: the default model); model_for checks its type."""
    return document.get("model") if isinstance(document, dict) else None


def embedding_response(
    outputs: list[dict[str, Any]], encoding_format: str, model_id: str
) -> dict[str, Any]:
    data = []
    for index, output in enumerate(outputs):
        vector = np.asarray(output["embedding"], dtype="<f4")
        embedding: Any = (
            base64.b64encode(vector.tobytes()).decode("ascii")
            if encoding_format == "base64"
            else vector
        )
        data.append({"object": "embedding", "index": index, "embedding": embedding})
    tokens = sum(int(output["tokens"]) for output in outputs)
    return {
        "object": "list",
        "data": data,
        "model": model_id,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }


async def check_prompt_room(
    tokenizers: ServerTokenizers,
    model: ServedModel,
    generation: GenerationRequest,
    chat: bool,
    scored: bool,
    remedy: str,
) -> None:
    """`check_lengths` for the prompts, counted once for the new tokens asked at the least:
    422 for a prompt past the positions, and 400 naming min_tokens where a prompt surely
    leaves less room than it asks, found here before anything is queued or streamed (the
    worker's exact count refuses the rest, a chat's template included: `name_field`);
    streamed, a later prompt's refusal came as an error event in another shape than the
    whole answer's 400. A refusal ends with `remedy`, what the route takes to cut one."""
    least = int(generation.params.get("min_new_tokens") or 0)
    # (vLLM's truncate_prompt_tokens, read as TGI's truncate: `prompt_cut`)
    cut = generation.params.get("truncate")
    if scored or least <= 1:
        await check_lengths(
            tokenizers, model, generation.items, chat, scored, truncate=cut, remedy=remedy
        )
        return
    try:
        await check_lengths(
            tokenizers, model, generation.items, chat, least_new=least, truncate=cut, remedy=remedy
        )
    except UnprocessableInput:
        # a prompt past the positions says so first; else only min_tokens is at fault
        await check_lengths(tokenizers, model, generation.items, chat, remedy=remedy)
        longest = None if chat else await longest_prompt(tokenizers, model, generation.items)
        message = min_tokens_past_room(least, longest, model.positions)
        raise BadRequest(message, param="min_tokens") from None


def name_field(
    error: HTTPError, generation: GenerationRequest, chat: bool, responses: bool = False
) -> None:
    """Name the request's field at fault as `error`'s `param`, where the worker could not:
    a grammar refused or failed is the field's that gave it ("tools", "response_format"),
    a prompt past the context length its prompt's ("messages", "prompt"), a min_tokens
    the prompt leaves no room for "min_tokens", a chat its template refused, or whose
    names hold a control token, the field that holds it (CHAT_REFUSALS; OpenAI's older
    `functions` where the request sent those). A chat's messages are the Responses API's
    (`responses`) "input"."""
    if error.status != 422:
        return
    if CONTEXT_LENGTH in error.message:  # OpenAI's code for it, which clients act on
        error.code = "context_length_exceeded"
    if error.param is not None:
        return
    messages = "input" if responses else "messages"
    if error.message.startswith((GRAMMAR_REFUSED, GRAMMAR_FAILED)):
        error.param = generation.grammar_field
    elif error.message.startswith(MIN_TOKENS_PAST_ROOM):
        error.param = "min_tokens"
    elif CONTEXT_LENGTH in error.message:
        error.param = messages if chat else "prompt"
    elif chat and (field := chat_field(error.message)) is not None:
        older = generation.tools is not None and generation.tools.older
        error.param = {"messages": messages, "tools": "functions" if older else "tools"}.get(
            field, field
        )


def chat_field(message: str) -> str | None:
    """The chat's field a worker's refusal of it names by its opening words."""
    return next((f for opening, f in CHAT_REFUSALS.items() if message.startswith(opening)), None)


class OpenAIRoutes:
    """Handlers for the /v1 routes; the served model's scheduler and workers do the work."""

    def __init__(self, context: RouteContext):
        self.context = context

    def routes(self) -> list[Route]:
        def queued(path: str, handler: Handler, operation: Operation, needs: Needs) -> Route:
            return Route("POST", path, handler, operation, needs, queued=True)

        embeddings = Operation(
            "Embeddings (OpenAI)",
            TAG,
            EMBEDDINGS.schema,
            lambda _: schemas.OPENAI_EMBEDDINGS_RESPONSE,
            errors=MODEL_ERRORS,
        )
        models = Operation(
            "The served models (OpenAI)", TAG, response=lambda _: schemas.MODELS_LIST
        )
        one_model = Operation(
            "One of the served models, by name (OpenAI)",
            TAG,
            response=lambda _: schemas.MODEL,
            errors=(404,),
        )
        chat = Operation(
            "Chat completions (OpenAI): messages rendered with the model's chat template",
            TAG,
            CHAT.schema,
            lambda _: schemas.OPENAI_CHAT_RESPONSE,
            errors=MODEL_ERRORS,
            events=lambda _: schemas.OPENAI_CHAT_CHUNK,
        )
        completions = Operation(
            "Completions (OpenAI)",
            TAG,
            COMPLETION.schema,
            lambda _: schemas.OPENAI_COMPLETION_RESPONSE,
            errors=MODEL_ERRORS,
            events=lambda _: schemas.OPENAI_COMPLETION_CHUNK,
        )
        responses = Operation(
            "Responses (OpenAI): input messages rendered with the model's chat template",
            TAG,
            RESPONSES.schema,
            lambda _: RESPONSE_SCHEMA,
            errors=MODEL_ERRORS,
            events=lambda _: EVENT_SCHEMA,
        )
        return [
            queued("/v1/embeddings", self.embeddings, embeddings, DENSE_EMBEDDING),
            queued("/v1/chat/completions", self.chat_completions, chat, CHAT_GENERATION),
            queued("/v1/completions", self.completions, completions, GENERATION),
            queued("/v1/responses", self.responses, responses, CHAT_GENERATION),
            *(
                Route(
                    "POST",
                    MODELS_PREFIX + name + path,
                    self.model_generation(model, answer),
                    schema,
                    GENERATION,
                    serves=model,
                )
                for model in self.context.models.all
                for name in model.names
                for path, answer, schema in zip(
                    MODEL_GENERATION_PATHS,
                    (self.chat, self.complete, self.respond),
                    (chat, completions, responses),
                    strict=True,
                )
            ),
            Route("GET", "/v1/models", self.models_list, models),
            *(
                Route("GET", OPENAI_MODEL_PREFIX + name, self.model_route(model), one_model)
                for model in self.context.models.all
                for name in model.names
            ),
        ]

    async def embeddings(self, request: HttpRequest) -> HttpResponse:
        document = read_json(request)
        model = self.context.model_for(named(document), DENSE_EMBEDDING, queued_for=request)
        fields = EMBEDDINGS.read(document)
        context = DocContext(model, self.context.settings.max_client_batch_size)
        inputs, params, encoding_format = parse_embeddings_request(fields, context)
        texts = [one for one in inputs if isinstance(one, str)]
        if len(texts) == len(inputs):  # texts, not token ids: those are read as sent
            inputs = [*prompted(model, texts, None)]  # the model's default prompt, if any
        # the worker answers {"embedding": float32 vector, "tokens": n} on this route
        results = await model.run(inputs, params, self.context.deadline(request), EMBEDDING_ROUTE)
        outputs = unwrap_all(results)
        return answer(embedding_response(outputs, encoding_format, model.name), results)

    async def chat_completions(self, request: HttpRequest) -> HttpResponse:
        document = read_json(request)
        model = self.context.model_for(named(document), CHAT_GENERATION, queued_for=request)
        return await self.chat(request, model, document)

    async def completions(self, request: HttpRequest) -> HttpResponse:
        document = read_json(request)
        model = self.context.model_for(named(document), GENERATION, queued_for=request)
        return await self.complete(request, model, document)

    async def responses(self, request: HttpRequest) -> HttpResponse:
        document = read_json(request)
        model = self.context.model_for(named(document), CHAT_GENERATION, queued_for=request)
        return await self.respond(request, model, document)

    def model_generation(self, model: ServedModel, answer: Answering) -> Handler:
        """POST /models/<name>/v1/chat/completions (or /v1/completions, /v1/responses), answered by
        `answer`: the path names the model; the body's "model" is not read
        (InferenceClient sends the URL there)."""

        async def handler(request: HttpRequest) -> HttpResponse:
            self.context.take(model, GENERATION)  # (a bad body to a model that cannot: 404)
            return await answer(request, model, read_json(request))

        return handler

    async def chat(self, request: HttpRequest, model: ServedModel, document: Any) -> HttpResponse:
        generation = parse_model_chat(model, document)
        if self.context.settings.thinking_in_content:  # (an answer held from its first token)
            generation.params[THINKING_IN_CONTENT] = True
        return await self.generate(request, model, generation, chat=True)

    async def respond(
        self, request: HttpRequest, model: ServedModel, document: Any
    ) -> HttpResponse:
        """A Response: its input is a chat, answered in the Responses API's shape."""
        check_chat_template(model)  # (before its fields: an effort is the template's)
        loaded = model.serving.loaded
        reads_effort = bool(loaded and loaded.details.get("chat_reads_reasoning_effort"))
        generation, settings = parse_response(document, reads_effort)
        settings = sampled_with(settings, loaded.details.get("sampling") if loaded else None)
        # a reasoning model's thinking, a reasoning item (but where the operator keeps it
        # in the answer's text: then a format holds the answer from its first token)
        thinking = None
        if self.context.settings.thinking_in_content:
            generation.params[THINKING_IN_CONTENT] = True
        else:
            thinking = answers_opening(model.thinking, generation.items)
        shape = ResponseAnswer(
            model.name, settings, thinking=thinking, logprobs=generation.logprobs
        )
        return await self.generate(request, model, generation, chat=True, shape=shape)

    async def complete(
        self, request: HttpRequest, model: ServedModel, document: Any
    ) -> HttpResponse:
        context = DocContext(model, self.context.settings.max_client_batch_size)
        generation = parse_completion(document, context)
        return await self.generate(request, model, generation, chat=False)

    async def generate(
        self,
        request: HttpRequest,
        model: ServedModel,
        generation: GenerationRequest,
        chat: bool,
        shape: Answer | ResponseAnswer | None = None,
    ) -> HttpResponse:
        """Queue the prompts like any text-generation request; answer whole or streamed, in
        `shape` (chat's or completions' where none is given). A grammar the worker cannot
        use is the fault of the field that gave it (`param`: "tools", "response_format"),
        a prompt past the context length its prompt's ("messages", "prompt")."""
        try:
            return await self._generate(request, model, generation, chat, shape)
        except UnprocessableInput as exc:
            name_field(exc, generation, chat, responses=isinstance(shape, ResponseAnswer))
            if exc.param == "min_tokens":  # a setting the prompt leaves no room for: as
                # one past max_tokens is (vLLM refuses what cannot fit), not an input's 422
                raise BadRequest(exc.message, param=exc.param) from None
            raise

    async def _generate(
        self,
        request: HttpRequest,
        model: ServedModel,
        generation: GenerationRequest,
        chat: bool,
        shape: Answer | ResponseAnswer | None,
    ) -> HttpResponse:
        check_max_tokens(generation, model.limits.max_new_tokens)
        loaded = model.serving.loaded
        check_token_ids(generation, loaded.details.get("vocabulary") if loaded else None)
        most = self.context.settings.max_client_batch_size
        check_choices(generation, most, model.serving.most_admitted)
        scored = generation.params.get("max_new_tokens") == 0  # echo: nothing after the prompt
        prompt_cut(generation, model.positions, scored)
        # (a Response takes no truncate_prompt_tokens: its refusal said to send one)
        remedy = UNCUT if isinstance(shape, ResponseAnswer) else CUT_WITH_TRUNCATE_PROMPT_TOKENS
        await check_prompt_room(self.context.tokenizers, model, generation, chat, scored, remedy)
        largest = self.context.settings.max_answer_bytes
        generated = 0  # the bytes the new tokens' log probabilities may take
        # (a chat's stream lists them as they go; a Response's ends with events that each
        # list them all, as its whole answer does)
        whole_listed = not generation.stream or isinstance(shape, ResponseAnswer)
        if generation.logprobs is not None and whole_listed:
            asked = generation.params.get("max_new_tokens")
            generated = check_generated_size(
                model.limits.default_new_tokens if asked is None else asked,
                generation.logprobs + 1,  # the chosen token is listed among them
                len(generation.items) * generation.generations,  # (best_of: each sent back)
                CHAT_LISTED_BYTES if chat else LISTED_BYTES,
                largest,
                generation.max_tokens_field,
            )
        if generation.echo and generation.logprobs is not None:
            await check_echo_size(
                self.context.tokenizers,
                model,
                generation.items,
                generation.logprobs + 1,
                generation.generations,
                largest,
                generated,
            )
        if shape is None:
            shape = Answer(
                chat,
                model.name,
                generation.logprobs,
                tools=generation.tools,
                stops_after=stops_after(generation.params),
                # a reasoning model's thinking, apart (before an answer a grammar holds
                # too: the worker holds it after the thinking), but where the operator
                # keeps it in the content
                thinking=None
                if not chat or self.context.settings.thinking_in_content
                else answers_opening(model.thinking, generation.items),
            )
        deadline = self.context.deadline(request)
        choices = generation.choice_params()
        if generation.stream:  # a stream a choice of each prompt, in OpenAI's order
            prompts = generation.items
            echo_texts = None
            if generation.echo:
                texts = await echoed_texts(self.context.tokenizers, model, prompts)
                echo_texts = [text for text in texts for _ in choices]
            # told once for the stream, naming the field at fault (a grammar failed midway)
            responses = isinstance(shape, ResponseAnswer)  # (its messages are its "input")
            named = functools.partial(name_field, generation=generation, chat=chat)
            end = StreamEnd(functools.partial(named, responses=responses))
            streams = [
                TokenStream(model, prompt, params, deadline, request.request_id, end)
                for prompt in prompts
                for params in choices
            ]
            # an error before the first token keeps its status (unless the keep-alive
            # interval passes before it: then it is an error event), another choice's too (a
            # refusal at admission: 503 with Retry-After, at once, as for one not streamed);
            # the other choices may wait for rows while the first one's tokens come, and are
            # read from then on (held back, those tokens would pile up for nobody): their
            # later errors are error events
            keepalive = self.context.settings.stream_keepalive
            await start_choices(streams, keepalive)
            events = shape.events(
                streams, generation.stop, generation.include_usage, len(choices), echo_texts
            )
            return event_stream(events, keepalive, streams)
        results = await run_choices(model, generation.items, choices, deadline)
        # the worker answers the pipeline's [{"generated_text", "details"}] per prompt
        outputs = [unwrap(result)[0] for result in results]
        if generation.best_of > generation.n:
            outputs = likeliest_choices(outputs, generation.best_of, generation.n)
        echoed = None
        if generation.echo:
            texts = await echoed_texts(self.context.tokenizers, model, generation.items)
            items = zip(texts, generation.items, strict=True)
            echoes = [Echo(text, isinstance(prompt, list)) for text, prompt in items]
            echoed = [echo for echo in echoes for _ in range(generation.n)]
        entries = listed_entries(outputs, generation.logprobs)
        build = functools.partial(shape.whole, outputs, generation.stop, echoed, generation.n)
        return await built_answer(build, results, entries)

    async def models_list(self, request: HttpRequest) -> HttpResponse:
        data = [self.model_object(model) for model in self.context.models.all]
        return json_response(200, {"object": "list", "data": data})

    def model_route(self, model: ServedModel) -> Handler:
        """GET /v1/models/<name>: the model as the list shows it (a name that is not
        served is the app's 404, OpenAI's `model_not_found`)."""

        async def handler(request: HttpRequest) -> HttpResponse:
            return json_response(200, self.model_object(model))

        return handler

    def model_object(self, model: ServedModel) -> dict[str, Any]:
        return {
            "id": model.name,
            "object": "model",
            "created": self.context.settings.started,
            "owned_by": "rawserve",
        }


# what a refusal of a prompt past the positions says, the server's and the worker's
CONTEXT_LENGTH = "longer than the model's context length"

"""TGI's routes for text-generation models: `POST /generate` (one prompt's answer) and
`POST /generate_stream` (its tokens as server-sent events), in Text Generation
Inference's request and answer shapes.

The body is TGI's `{"inputs": "...", "parameters": {...}}`: the text-generation task's
own rules check it (`rawserve.tasks.text_generation`, whose parameters are TGI's: those
rawserve cannot honour are taken only unset, else 422 naming them), and the generation
goes the way of `POST /` (the scheduler, the worker's `causal_lm`, `streaming` for the
events). The answers are TGI's: `{"generated_text", "details"}` with `details` when asked
(`finish_reason`, `generated_tokens`, `seed`, `prefill`, `tokens`), and the stream's
`{"index", "token", "generated_text", "details"}` events, the text on the last. Where
several models are served, the body's `"model"` picks one (TGI serves one); without it, the
first served one that generates.
Errors keep rawserve's `{"error", "error_type"}`, which is TGI's own shape, with TGI's
types (`rawserve.http.errors.tgi_error`: what TGI's validation refuses is 422
"validation"), as on `POST /` for this task, where TGI's clients post too.
Server process; never imports torch.
"""

from __future__ import annotations

from typing import Any

from rawserve.api import chat_tokens, schemas
from rawserve.api.best_of import asked_copies, best_of_each, repeated, run_copies
from rawserve.api.bodies import built_answer, read_json
from rawserve.api.context import RouteContext
from rawserve.api.fields import MODEL
from rawserve.api.inference import ParsedRequest, inference_request, parse_json_body
from rawserve.api.openai_generation import CHAT, GENERATION
from rawserve.api.prompts import check_details_size, check_tgi_lengths
from rawserve.api.routing import MODEL_ERRORS, DocContext, Operation, Route, Schema
from rawserve.api.served import ServedModel
from rawserve.api.streaming import open_token_stream
from rawserve.http.errors import BadRequest
from rawserve.http.exchange import HttpRequest, HttpResponse
from rawserve.tasks import InvalidRequest, check_generation_length
from rawserve.tasks.text_generation import (
    API_SAMPLING,
    MAX_BEST_OF,
    MAX_STOP_SEQUENCES,
    listed_tokens,
    prompt_details_on,
    tgi_output,
)

TAG = "TGI"
TASK = "text-generation"
GENERATE = "/generate"
GENERATE_STREAM = "/generate_stream"
CHAT_TOKENIZE = "/chat_tokenize"
PATHS = frozenset({GENERATE, GENERATE_STREAM, CHAT_TOKENIZE})  # (whose errors are TGI's)

TOKEN: Schema = {
    "type": "object",
    "required": ["id", "text", "logprob", "special"],
    "properties": {
        "id": {"type": "integer"},
        "text": {"type": "string"},
        "logprob": {"type": "number"},
        "special": {"type": "boolean"},
    },
}
# a prompt's token: no `special`, and the first one's `logprob` null (nothing before it)
PREFILL_TOKEN: Schema = {
    "type": "object",
    "required": ["id", "text", "logprob"],
    "properties": {
        "id": {"type": "integer"},
        "text": {"type": "string"},
        "logprob": {"type": ["number", "null"]},
    },
}
# an answer's details (TGI's `Details`), and those of each answer `best_of` did not choose
# (its `BestOfSequence`: the same, with the answer's text)
DETAILS_REQUIRED = ["finish_reason", "generated_tokens", "seed", "prefill", "tokens"]
DETAILS_PROPERTIES: Schema = {
    "finish_reason": {"enum": ["length", "eos_token", "stop_sequence"]},
    "generated_tokens": {"type": "integer"},
    "seed": {"type": ["integer", "null"]},
    "prefill": {
        "type": "array",
        "items": PREFILL_TOKEN,
        "description": "the prompt's tokens, with `decoder_input_details`",
    },
    "tokens": {"type": "array", "items": TOKEN},
    "top_tokens": {
        "type": "array",
        "items": {"type": "array", "items": TOKEN},
        "description": "with `top_n_tokens`: each new token's likeliest",
    },
}
BEST_OF_SEQUENCE: Schema = {
    "type": "object",
    "required": ["generated_text", *DETAILS_REQUIRED],
    "properties": {"generated_text": {"type": "string"}, **DETAILS_PROPERTIES},
}
GENERATE_RESPONSE: Schema = {
    "type": "object",
    "required": ["generated_text"],
    "properties": {
        "generated_text": {"type": "string"},
        "details": {
            "type": "object",
            "description": "with `parameters.details`",
            "required": DETAILS_REQUIRED,
            "properties": {
                **DETAILS_PROPERTIES,
                "best_of_sequences": {
                    "type": "array",
                    "items": BEST_OF_SEQUENCE,
                    "description": "with `best_of` above 1: the answers not chosen, "
                    "each with its own details",
                },
            },
        },
    },
}


def tgi_info(model: ServedModel, max_client_batch_size: int | None = None) -> dict[str, Any]:
    """TGI's /info fields, for a model that generates (TGI's `Info` requires them): its
    limits as rawserve checks them, `max_input_length` as TGI 1.x meant it (a prompt's
    most tokens) in place of TEI's; `max_best_of` within `max_client_batch_size` and what
    admission takes of one request (each answer an item of the request)."""
    if model.task != TASK:
        return {}
    positions = model.positions
    max_input_tokens = max(positions - 1, 0)  # a prompt leaves room for one token
    return {
        "model_pipeline_tag": TASK,
        "max_best_of": min(
            MAX_BEST_OF,
            max_client_batch_size or MAX_BEST_OF,
            model.serving.most_admitted or MAX_BEST_OF,
        ),
        "max_stop_sequences": MAX_STOP_SEQUENCES,
        "max_input_tokens": max_input_tokens,
        # TGI 1.x's name of the same limit (TEI's field of this name is an encoder's length)
        "max_input_length": max_input_tokens,
        "max_total_tokens": positions,
        "validation_workers": len(model.serving.snapshot().workers),
        "router": "rawserve",
    }


def generate_request(context: DocContext) -> Schema:
    """TGI's body: `POST /`'s for the text-generation task, one text as `inputs`, and the
    "model" field that picks one of several served models, as on the other API routes."""
    schema = inference_request(context)
    inputs = {"type": "string", "minLength": 1, "description": "the prompt: one text"}
    properties = {**schema["properties"], "inputs": inputs, "model": MODEL.schema_in(context)}
    described = "TGI's: one prompt, and the task's parameters"
    return {**schema, "description": described, "properties": properties}


class TgiRoutes:
    """Handlers for `/generate` and `/generate_stream`."""

    def __init__(self, context: RouteContext):
        self.context = context

    def routes(self) -> list[Route]:
        generate = Operation(
            "Generate (TGI): the continuation of one prompt, with its details when asked",
            TAG,
            generate_request,
            lambda _: GENERATE_RESPONSE,
            errors=(*MODEL_ERRORS, 422),
        )
        generate_stream = Operation(
            "Generate (TGI), streamed: one server-sent event per new token",
            TAG,
            generate_request,
            media_type="text/event-stream",
            errors=(*MODEL_ERRORS, 422),
            events=schemas.generation_events,
        )
        chat_tokenize = Operation(
            "A chat's text as its template writes it, and that text's tokens (TGI)",
            TAG,
            CHAT.schema,
            lambda _: chat_tokens.CHAT_TOKENIZE_RESPONSE,
            errors=(*MODEL_ERRORS, 422),
        )
        return [
            Route("POST", GENERATE, self.generate, generate, GENERATION, queued=True),
            Route(
                "POST",
                CHAT_TOKENIZE,
                self.chat_tokenize,
                chat_tokenize,
                chat_tokens.CHAT_TOKENIZER,
                queued=True,
            ),
            Route(
                "POST",
                GENERATE_STREAM,
                self.generate_stream,
                generate_stream,
                GENERATION,
                queued=True,
            ),
        ]

    async def generate(self, request: HttpRequest) -> HttpResponse:
        model, parsed = await self.parse(request)
        most = self.context.settings.max_client_batch_size
        admitted = model.serving.most_admitted
        copies = asked_copies(parsed.params, 1, most, False, admitted)  # (TGI's best_of)
        largest = self.context.settings.max_answer_bytes
        tokenizers = self.context.tokenizers
        answers = repeated(parsed.inputs, copies)  # (their details, where asked, listed)
        await check_details_size(tokenizers, model, answers, parsed.params, largest)
        deadline = self.context.deadline(request)
        results = await run_copies(model, parsed.inputs, parsed.params, copies, deadline)
        # the pipeline's [{"generated_text", "details"}], of the best of the copies
        [[output]] = best_of_each(results, copies, bool(parsed.params.get("details")))
        entries = sum(listed_tokens(each) for result in results for each in result.output)
        # a long prompt's tokens listed make an answer of megabytes: built on a thread
        return await built_answer(lambda: tgi_output(output), results, entries)

    async def generate_stream(self, request: HttpRequest) -> HttpResponse:
        model, parsed = await self.parse(request)
        asked_copies(parsed.params, 1, 1, streamed=True)  # (TGI streams one answer)
        deadline = self.context.deadline(request)
        keepalive = self.context.settings.stream_keepalive
        return await open_token_stream(
            model, parsed.inputs[0], parsed.params, deadline, keepalive, request.request_id
        )

    async def chat_tokenize(self, request: HttpRequest) -> HttpResponse:
        return await chat_tokens.tgi_chat_tokenized(self.context, request, read_json(request))

    async def parse(self, request: HttpRequest) -> tuple[ServedModel, ParsedRequest]:
        """The generation model, and the body's prompt and checked parameters; a prompt
        that leaves the model no room is refused here, before it queues."""
        document = read_json(request)
        name = None
        if isinstance(document, dict):
            if "inputs" in document and not isinstance(document["inputs"], str):
                raise BadRequest('"inputs" must be one text')
            name = document.get("model")
            # the route says whether it streams, as TGI's router ignores "stream" here; but
            # it is left in to be checked: documented a boolean, anything else was taken
            document = {k: v for k, v in document.items() if k != "model"}
        model = self.context.model_for(name, GENERATION, queued_for=request)
        parsed = parse_json_body(TASK, document, 1)
        # TGI's defaults: the continuation alone, and greedy (a temperature, top_k or top_p
        # asks for sampling in the worker, as TGI reads them)
        params: dict[str, Any] = {
            "return_full_text": False,
            "do_sample": False,
            **parsed.params,
            API_SAMPLING: True,
        }
        params = prompt_details_on(params)
        try:
            check_generation_length(params, model.limits.max_new_tokens)
        except InvalidRequest as exc:
            raise BadRequest(str(exc)) from None
        await check_tgi_lengths(self.context.tokenizers, model, parsed.inputs, params)
        return model, ParsedRequest(parsed.inputs, params, is_list=False)

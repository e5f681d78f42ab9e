"""`POST /`: the seed's endpoint, in the Hugging Face Inference API's shapes.

A raw (non-JSON) body is one input, as `curl -d` sends it (or an image's bytes for image
tasks); a JSON body is `{"inputs": X, "parameters": {...}}` with X one input or a list.
Inputs and parameters are checked against the task's rules (rawserve.tasks) before they
are queued; the answer is shaped per task as the Inference API answers.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any

from rawserve.api import schemas
from rawserve.api.best_of import asked_copies, best_of_each, repeated, run_copies
from rawserve.api.bodies import (
    built_answer,
    check_client_batch,
    is_json,
    read_json,
    read_text,
    refuse_form_upload,
    vector_entries,
)
from rawserve.api.context import RouteContext
from rawserve.api.fields import Body, Field, flag
from rawserve.api.hypotheses import check_hypotheses
from rawserve.api.outcomes import unwrap_all
from rawserve.api.prompts import (
    UNCUT_TASKS,
    check_details_size,
    check_input_lengths,
    check_tgi_lengths,
)
from rawserve.api.routing import (
    ANY_MODEL,
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
from rawserve.api.streaming import open_token_stream
from rawserve.api.tei import sentence_similarity
from rawserve.api.tei_bodies import INFERENCE_SIMILARITY
from rawserve.api.tokens import AnswerTooLarge
from rawserve.api.window_checks import WINDOWED_TASKS, check_windows
from rawserve.http.errors import BadRequest, PayloadTooLarge, UnknownFields, UnprocessableInput
from rawserve.http.exchange import HttpRequest, HttpResponse
from rawserve.tasks import (
    CUSTOM_TASK,
    BlankInput,
    InvalidRequest,
    Task,
    UnknownParameters,
    UnservedParameter,
    check_generation_length,
    check_input,
    check_params,
    other_tasks_fields,
    shape_answer,
    task_rules,
)
from rawserve.tasks.image_classification import image_from_body
from rawserve.tasks.text_generation import listed_tokens, prompt_details_on, tgi_output

MODELS_PREFIX = "/models/"  # POST /models/<name>: one of the served models, by any name
# a fill-mask candidate's bytes beside its `sequence` (its score, token and token_str,
# and the keys), and the candidates a mask gets unless `top_k` says (the pipeline's)
CANDIDATE_BYTES = 80
FILL_MASK_TOP_K = 5


@dataclass(frozen=True)
class ParsedRequest:
    inputs: list[Any]
    params: dict[str, Any]
    is_list: bool  # answer a list (the client sent a list of inputs)
    stream: bool = False  # answer text/event-stream, one event per new token
    raw_text: bool = False  # a raw-text body: answered in `pipe(text)`'s shape


@functools.cache
def inference_body(task_name: str) -> Body:
    """`{"inputs": X, "parameters": {...}}` as the task takes it: its fields, and their
    schemas from the task's own checkers (a custom handler takes any input and parameters).
    Unknown fields and parameters are refused: a misspelt one would change nothing."""
    task = task_rules(task_name)
    options = Field(
        {"type": ["object", "null"]},
        description="accepted and ignored (the Inference API's options: use_cache, wait_for_model)",
    )
    if task is None:
        return Body(
            {
                "inputs": Field({"not": {"type": "array", "maxItems": 0}}, required=True),
                "parameters": Field({"type": ["object", "null"]}),
                "options": options,
            },
            with_model=False,
        )
    item = task.check_input.schema
    params = {
        name: {"anyOf": [check.schema, {"type": "null"}]} for name, check in task.params.items()
    }

    def inputs(context: DocContext) -> Schema:
        many = {"type": "array", "items": item, "minItems": 1, "maxItems": context.max_inputs}
        return {"oneOf": [item, many]}

    parameters = {
        "type": ["object", "null"],
        "properties": params,
        "required": sorted(task.required_params),
        "additionalProperties": False,
    }
    fields = {
        "inputs": Field(inputs, required=True),
        "parameters": Field(parameters, required=bool(task.required_params)),
        "options": options,
    }
    if task.params_at_root:  # InferenceClient sends these beside "inputs"
        fields.update({name: Field(schema) for name, schema in params.items()})
    if "stream" in task.extra_fields:
        fields["stream"] = flag(
            False, "answer text/event-stream, a token an event (one input only)"
        )
    return Body(
        fields,
        with_model=False,
        description=f"{task.name}: one input or a list, and the task's parameters",
    )


def inference_request(context: DocContext) -> Schema:
    """The schema of `POST /`'s JSON body for the served model's task."""
    return inference_body(context.model.known_task or "").schema(context)


def parse_json_body(task_name: str, document: Any, max_items: int = 32) -> ParsedRequest:
    """Check an Inference-API shaped body `{"inputs": X, "parameters": {...}}` (at most
    `max_items` inputs)."""
    if not isinstance(document, dict) or "inputs" not in document:
        raise BadRequest('the JSON body must be an object with an "inputs" field')
    body = inference_body(task_name)
    unknown = sorted(set(document) - set(body.names))
    if elsewhere := other_tasks_fields(task_name, unknown, ", ".join(sorted(body.names))):
        raise UnknownFields(elsewhere)
    fields = body.read(document)  # unknown fields: 400
    task = task_rules(task_name)
    raw_inputs = document["inputs"]
    is_list = isinstance(raw_inputs, list)
    items = raw_inputs if is_list else [raw_inputs]
    if not items:
        raise BadRequest('"inputs" must not be an empty list')
    check_client_batch(len(items), max_items)
    params = document.get("parameters")
    if params is None:
        params = {}
    if not isinstance(params, dict):
        raise BadRequest('"parameters" must be an object')
    if not isinstance(document.get("options", {}), (dict, type(None))):
        raise BadRequest('"options" must be an object')
    if task is None:  # custom handler: it validates what it is given
        return ParsedRequest(list(items), dict(params), is_list)
    if task.params_at_root:
        at_root = {k: v for k, v in document.items() if k in task.params and v is not None}
        # (a null is no value; true and 1 are two values, one of them refused)
        differing = sorted(
            k
            for k, v in at_root.items()
            if params.get(k) is not None and (type(params[k]), params[k]) != (type(v), v)
        )
        if differing:
            raise BadRequest(
                f'"{differing[0]}" is given beside "inputs" and in "parameters" with different'
                " values: send one"
            )
        params = {**params, **at_root}
    stream = fields.value("stream") if "stream" in body.fields else False
    if stream and is_list:
        raise BadRequest("a streamed answer takes one input, not a list")
    try:
        inputs = checked_inputs(task, items)
        checked = check_params(task, params)
    except (BlankInput, UnservedParameter) as exc:
        raise UnprocessableInput(str(exc)) from None
    except InvalidRequest as exc:
        error = BadRequest(str(exc))
        # (every parameter the task takes, which a cut would hide: its client's bounded)
        error.whole = isinstance(exc, UnknownParameters)
        raise error from None
    return ParsedRequest(inputs, checked, is_list, stream=stream)


def checked_inputs(task: Task, items: list[Any]) -> list[Any]:
    """Each input as the task's rules take it; of several, a refusal says which input it
    was, as the worker's refusals do (of a list with one blank text, its client could not
    tell which)."""
    checked = []
    for index, item in enumerate(items):
        try:
            checked.append(check_input(task, item))
        except (BlankInput, InvalidRequest) as exc:
            if len(items) == 1:
                raise
            raise type(exc)(f"the input at index {index}: {exc}") from None
    return checked


def parse_text_body(task_name: str, text: str) -> ParsedRequest:
    """A raw (non-JSON) body is one input, as `curl -d` sends it."""
    task = task_rules(task_name)
    if task is None:
        return ParsedRequest([text], {}, is_list=False, raw_text=True)
    try:
        item = check_input(task, text)
        check_params(task, {})  # a task with required parameters needs JSON
    except BlankInput as exc:
        raise UnprocessableInput(str(exc)) from None
    except InvalidRequest as exc:
        raise BadRequest(str(exc)) from None
    return ParsedRequest([item], {}, is_list=False, raw_text=True)


def is_sentence_pairs(document: Any) -> bool:
    """A body of sentence-similarity's shape, `{"inputs": {"source_sentence", "sentences"}}`,
    which the Inference API takes on an embedding model's URL."""
    return isinstance(document, dict) and isinstance(document.get("inputs"), dict)


def takes_binary_body(task_name: str | None) -> bool:
    """Whether a non-JSON body is this task's input as bytes (an image) rather than text."""
    task = task_rules(task_name) if task_name else None
    return task is not None and task.binary_input


def parse_binary_body(task_name: str, body: bytes) -> ParsedRequest:
    """A raw body for a task that takes bytes: one input, queued as base64 text."""
    if not body:
        raise UnprocessableInput("the body is empty: send the image's bytes")
    return ParsedRequest([image_from_body(body)], {}, is_list=False)


def parse_body(task: str | None, request: HttpRequest, max_items: int) -> ParsedRequest:
    """The request's inputs and parameters, checked against the task's rules."""
    if is_json(request):
        return parse_json_body(task or "", read_json(request), max_items)
    if takes_binary_body(task):  # an image's bytes, with or without image/* type
        refuse_form_upload(request, "the image's bytes (curl --data-binary @image.png)")
        return parse_binary_body(task or "", request.body)
    return parse_text_body(task or "", read_text(request))


def check_fillings_size(
    model: ServedModel, texts: list[Any], params: dict[str, Any], largest: int
) -> None:
    """413 where a fill-mask answer would hold more than `largest` bytes, before the
    model runs: each mask's candidates (`top_k`, or the targets) repeat the whole text in
    their `sequence` (16 texts of 126 masks, 14 KB sent, top_k 100: 159 MB answered)."""
    loaded = model.serving.loaded
    mask = loaded.details.get("mask_token") if loaded is not None else None
    if not isinstance(mask, str) or not mask:
        return
    targets = params.get("targets")
    candidates = params.get("top_k", FILL_MASK_TOP_K)
    if targets:  # each scored once, and top_k of them kept, as the pipeline answers
        named = 1 if isinstance(targets, str) else len(set(targets))
        candidates = min(candidates, named)
    size = sum(
        text.count(mask) * candidates * (len(text.encode()) + CANDIDATE_BYTES)
        for text in texts
        if isinstance(text, str)
    )
    if size > largest:
        raise PayloadTooLarge(str(AnswerTooLarge(largest, "fewer masks, texts or candidates")))


class InferenceRoutes:
    """`POST /` for the default model, `POST /models/<name>` for any served model."""

    def __init__(self, context: RouteContext):
        self.context = context

    def routes(self) -> list[Route]:
        operation = Operation(
            "Run the model on an input or a list of them (the Hugging Face Inference API)",
            "Inference",
            inference_request,
            schemas.inference_response,
            errors=MODEL_ERRORS,
            events=schemas.generation_events,
            text_body=True,
        )
        routes = [Route("POST", "/", self.infer, operation)]
        for model in self.context.models.all:
            named = replace(operation, summary=f"POST / for the model {model.name!r}")
            handler = self.model_route(model)
            routes += [
                Route("POST", MODELS_PREFIX + name, handler, named, serves=model)
                for name in model.names
            ]
        return routes

    def refuse_now(
        self, request: HttpRequest, model: ServedModel | None = None, needs: Needs = ANY_MODEL
    ) -> None:
        """Raise what `POST /` (or a path of the model's own) gets now without reading its
        body: the 404 of a model that does not fit the path, the 503 of one that cannot take
        work (draining, loading, the queue full, a generation's row out of reach by the
        request's deadline), so a refusal under overload is answered in the pass that read it."""
        model = model or self.context.models.default
        self.context.take(model, needs)
        model.refuse_if_busy(self.context.deadline(request))

    def refuse_now_if_none_can(self, request: HttpRequest, needs: Needs) -> None:
        """For a route whose body names the model (OpenAI, TEI, TGI): raise the 503 of
        the one model served when it cannot take work now, or the 404 when none fits the
        route at all, without reading the body. Of several served, the body says which:
        its refusal (`model_for`) comes before it is checked or tokenized, and is counted
        for that model (one from the head was counted for the first of them), and a name
        not served is a 404 whatever the others' states (where one fitted the route, its
        503 answered a typo, a refusal that clients and proxies retry)."""
        models = self.context.models.all
        fitting = [model for model in models if needs.missing(model) is None]
        if not fitting:  # every body gets the route's 404 (what each serves): from the head
            self.context.model_for(None, needs)  # (raises it)
            return
        if len(models) == 1:
            self.refuse_now(request, fitting[0])

    async def infer(self, request: HttpRequest) -> HttpResponse:
        return await self.infer_with(self.context.models.default, request)

    def model_route(self, model: ServedModel) -> Callable[[HttpRequest], Awaitable[HttpResponse]]:
        """The handler of `POST /models/<name>`: `POST /` for that model."""

        async def infer_named(request: HttpRequest) -> HttpResponse:
            return await self.infer_with(model, request)

        return infer_named

    async def infer_with(self, model: ServedModel, request: HttpRequest) -> HttpResponse:
        self.context.gate.check(model)
        task = model.task
        max_items = self.context.settings.max_client_batch_size
        if not is_json(request):
            parsed = parse_body(task, request, max_items)
        else:
            document = read_json(request)
            if task == "feature-extraction" and is_sentence_pairs(document):
                # InferenceClient's sentence_similarity: of dense vectors, as /similarity
                self.context.take(model, DENSE_EMBEDDING)
                fields = INFERENCE_SIMILARITY.read(document)
                return await sentence_similarity(self.context, model, fields, request)
            parsed = parse_json_body(task or "", document, max_items)
        if task == "text-generation":  # TGI's parameters, as /generate reads them
            parsed = replace(parsed, params=prompt_details_on(parsed.params))
        if task == "feature-extraction":  # the model's own prompt before each text
            params = dict(parsed.params)
            inputs = prompted(model, parsed.inputs, params.pop("prompt_name", None))
            parsed = replace(parsed, inputs=inputs, params=params)
        try:
            if task != CUSTOM_TASK:  # (a handler's own parameters are its to read)
                check_generation_length(parsed.params, model.limits.max_new_tokens)
        except InvalidRequest as exc:
            raise BadRequest(str(exc)) from None
        copies = 1  # TGI's best_of: so many answers of each prompt, the likeliest given
        if task == "text-generation":
            await check_tgi_lengths(self.context.tokenizers, model, parsed.inputs, parsed.params)
            admitted = model.serving.most_admitted
            prompts = len(parsed.inputs)
            copies = asked_copies(parsed.params, prompts, max_items, parsed.stream, admitted)
        elif task in UNCUT_TASKS:
            await check_input_lengths(self.context.tokenizers, model, parsed.inputs)
        elif task in WINDOWED_TASKS:
            await check_windows(self.context.tokenizers, model, parsed.inputs, parsed.params)
        elif task == "zero-shot-classification":
            await check_hypotheses(self.context.tokenizers, model, parsed.inputs, parsed.params)
        deadline = self.context.deadline(request)
        if parsed.stream:
            keepalive = self.context.settings.stream_keepalive
            return await open_token_stream(
                model, parsed.inputs[0], parsed.params, deadline, keepalive, request.request_id
            )
        largest = self.context.settings.max_answer_bytes
        if task == "text-generation":
            tokenizers = self.context.tokenizers
            answers = repeated(parsed.inputs, copies)  # (their details, where asked, listed)
            await check_details_size(tokenizers, model, answers, parsed.params, largest)
        elif task == "fill-mask":
            check_fillings_size(model, parsed.inputs, parsed.params, largest)
        results = await run_copies(model, parsed.inputs, parsed.params, copies, deadline)
        if copies > 1:  # (each prompt's answers in a row: its failure named as the prompt's)
            outputs = best_of_each(results, copies, bool(parsed.params.get("details")))
        else:
            outputs = unwrap_all(results)
        # feature-extraction's token vectors make answers of tens of megabytes, and so do
        # text-generation's details listing a long prompt's tokens
        if task == "text-generation":  # the pipeline's [{"generated_text", "details"}]
            made = [result.output for result in results]
            generated = [output for output in made if isinstance(output, list)]
            entries = sum(listed_tokens(each) for output in generated for each in output)
        else:
            entries = vector_entries(outputs)

        def build() -> Any:
            shaped = outputs
            if task == "text-generation":
                shaped = [
                    [tgi_output(each) for each in output] if isinstance(output, list) else output
                    for output in outputs
                ]
            return shape_answer(task, shaped, parsed.is_list, raw_text=parsed.raw_text)

        return await built_answer(build, results, entries)

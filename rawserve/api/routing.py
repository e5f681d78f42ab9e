"""The route table's pieces: a `Route` (method, path, handler, what it needs of the served
model, and its OpenAPI description) and `Needs`, the one rule that says whether a route
fits a model. The app dispatches on the table and `/openapi.json` describes the same
table; a handler that picks its model from the body checks the same `Needs` (404 naming
what the route needs).

Server process; never imports h11 or torch.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rawserve.api.served import ServedModel
from rawserve.http.exchange import HttpRequest, HttpResponse
from rawserve.tasks import task_rules

Handler = Callable[[HttpRequest], Awaitable[HttpResponse]]
Schema = dict[str, Any]


@dataclass(frozen=True)
class Needs:
    """What a route needs of the model it serves; the default needs nothing."""

    tasks: frozenset[str] = frozenset()  # one of these tasks (empty: any)
    what: str = ""  # how a refusal names what is needed, e.g. "a feature-extraction model"
    tokenizer: bool = False  # a tokenizer the server can use (its JSON form)
    labels: int | None = None  # exactly this many labels (a cross-encoder has one)
    # a SPLADE model (True: its sparse vectors), or any other (False: dense vectors)
    sparse: bool | None = None
    # a chat template (the tokenizer's or --chat-template): a body that names no model is
    # given one with a template over one without (named, one without is told how to give
    # it one: rawserve.api.openai_generation.check_chat_template)
    chat: bool = False
    # a worker ready; else the server's own copy of the tokenizer is enough (/tokenize and
    # /decode answer while a worker restarts: the tokenizer came with the first load)
    worker: bool = True
    # fits where any of these fits (vLLM's /score: a cross-encoder, or dense vectors)
    any_of: tuple[Needs, ...] = ()

    def missing(self, model: ServedModel) -> str | None:
        """Why `model` cannot serve the route (a 404's message), or None when it can or
        when it is not known yet (no worker has loaded: the gate answers 503 then)."""
        unfit = self.unfit(model)
        return None if unfit is None else f"this route needs {self.what}; {unfit}"

    def none_fits(self, models: Sequence[ServedModel]) -> str | None:
        """Why none of several served models can serve the route (a 404's message naming
        each and what it serves), or None when one can or may."""
        unfit = [self.unfit(model) for model in models]
        if any(reason is None for reason in unfit):
            return None
        served = ", ".join(reason for reason in unfit if reason is not None)
        return f"this route needs {self.what}; no served model fits ({served})"

    def unfit(self, model: ServedModel) -> str | None:
        """What `model` serves that the route cannot use, e.g. "'emb' serves
        feature-extraction"; None when it fits, or may: before a worker has loaded it,
        only its folder's task is known (so a model still loading never takes the
        requests of a route that another, ready, model fits)."""
        loaded = model.serving.loaded
        task = model.known_task
        if self.any_of:  # the reason of the one of the model's task, where one is
            reasons = [(task in needs.tasks, needs.unfit(model)) for needs in self.any_of]
            return None if any(r is None for _, r in reasons) else max(reasons)[1]
        serves = f"{model.name!r} serves {task}"
        if self.tasks and isinstance(task, str) and task not in self.tasks:
            return serves
        pooling = model.facts.get("pooling")  # its folder's: known before it loads
        if self.sparse is not None and self.sparse != (pooling == "splade"):
            return f"{serves} with {pooling} pooling"
        if loaded is None:  # (an image model's task says it has no tokenizer)
            rules = task_rules(task) if self.tokenizer and isinstance(task, str) else None
            return f"{serves} without a tokenizer" if rules and rules.binary_input else None
        if self.tokenizer and loaded.tokenizer is None:
            return f"{serves} without a tokenizer"
        if self.labels is not None:
            labels = len(loaded.details.get("id2label", {}))
            if labels != self.labels:
                return f"{serves} with {labels} labels"
        return None

    def rank(self, model: ServedModel) -> int:
        """Where `model`, fitting the route, stands for a body naming no model (the lowest
        first): with `chat`, one known to have a chat template, then one still loading
        (it may have one: its requests wait for it, 503, rather than going to a model
        that surely has none), then one without."""
        if not self.chat:
            return 0
        loaded = model.serving.loaded
        if loaded is None:
            return 1
        return 0 if loaded.details.get("chat_template") else 2


ANY_MODEL = Needs()
# the routes of dense sentence vectors (OpenAI's embeddings, TEI's /embed_all and
# /similarity): a SPLADE model's vectors are TEI's /embed_sparse's
DENSE_EMBEDDING = Needs(
    frozenset({"feature-extraction"}), "a feature-extraction model of dense vectors", sparse=False
)


@dataclass(frozen=True)
class DocContext:
    """What a route's schemas depend on: the model it serves, and the input cap."""

    model: ServedModel
    max_inputs: int
    # other models serve the route too (a body naming one): a bound of this one's alone
    # is not the route's (say, `dimensions`' largest)
    shared: bool = False


SchemaOf = Callable[[DocContext], Schema]


def no_schema(context: DocContext) -> Schema:
    return {}


@dataclass(frozen=True)
class Operation:
    """A route as `/openapi.json` describes it. The schemas are functions of the served
    model, so that `POST /` is described for the model's own task."""

    summary: str
    tag: str
    request: SchemaOf | None = None  # its JSON body; None: it takes no body
    response: SchemaOf = no_schema  # its 200 answer
    media_type: str = "application/json"  # of the 200 answer
    errors: tuple[int, ...] = ()  # the error statuses it may answer
    # what each event of a text/event-stream answer holds (None: it never streams)
    events: Callable[[DocContext], Schema | None] | None = None
    text_body: bool = False  # also takes a raw text body (POST /, as `curl -d` sends)
    answers: Mapping[int, Schema] = field(default_factory=dict)  # other statuses, not errors
    parameters: tuple[Schema, ...] = ()  # its query parameters, as OpenAPI's objects


# what a route that queues model work may answer besides 200 (401 is added with --api-key;
# 415: a form upload, or a body typed as media no JSON is, read by every route's body check)
MODEL_ERRORS = (400, 404, 413, 415, 422, 500, 503, 504)


@dataclass(frozen=True)
class Route:
    method: str
    path: str
    handler: Handler
    operation: Operation
    needs: Needs = ANY_MODEL
    serves: ServedModel | None = None  # the one model it serves (None: the default, or named)
    secured: bool = True  # needs the API key when one is set
    # Its work waits in the queue of the model its body names: while no model that fits
    # the route can take work, it is refused from its head (rawserve.api.app.answer_now).
    queued: bool = False

"""What every family of routes shares: the served models, the gate, the options;
and which model a body's "model" field selects."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rawserve.api.bodies import request_timeout
from rawserve.api.gate import Gate
from rawserve.api.routing import ANY_MODEL, Needs
from rawserve.api.served import ServedModel, ServedModels
from rawserve.api.settings import AppSettings
from rawserve.api.tokens import ServerTokenizers
from rawserve.http.errors import NoModelFits, NotFound
from rawserve.http.exchange import HttpRequest


@dataclass(frozen=True)
class RouteContext:
    models: ServedModels
    settings: AppSettings = field(default_factory=AppSettings)
    gate: Gate = field(default_factory=Gate)
    tokenizers: ServerTokenizers = field(default_factory=ServerTokenizers)  # models', here

    def deadline(self, request: HttpRequest) -> float:
        """When the request must be answered: its X-Request-Timeout or the default, from
        when its head arrived (not from when its body was read and checked: a list of long
        texts, each tokenized for its length, had its 504 up to 0.37 s late)."""
        return request.received_at + self.timeout_seconds(request)

    def timeout_seconds(self, request: HttpRequest) -> float:
        """Seconds the request may take from its head: X-Request-Timeout (at most
        --max-timeout) or --timeout."""
        return request_timeout(request, self.settings.timeout, self.settings.max_timeout)

    def model_for(
        self, name: Any, needs: Needs = ANY_MODEL, queued_for: HttpRequest | None = None
    ) -> ServedModel:
        """The model a body's "model" field selects, taking work now (503 while loading or
        draining) and fitting the route (404 saying what it needs). `queued_for`: the
        request, on a route that queues work for the model: its 503 where it could not be
        admitted now (the queue full, a generation's row out of reach by its deadline),
        before the body is checked or tokenized, and counted for the model it names."""
        model = self.select(name, needs)
        self.take(model, needs, named=name is not None)
        if queued_for is not None:
            model.refuse_if_busy(self.deadline(queued_for))
        return model

    def take(self, model: ServedModel, needs: Needs, named: bool = False) -> None:
        """Raise unless `model` fits the route (404 saying what it needs: what a model
        serves is known while it restarts, and a retry would not change it) and takes
        work now (503 while loading or draining)."""
        if (missing := needs.missing(model)) is not None:  # (`named`: by the body's field)
            raise NotFound(missing, param="model" if named else None)
        self.gate.check(model, worker=needs.worker)

    def select(self, name: Any, needs: Needs) -> ServedModel:
        """The model a body names (`ServedModels.named`); a body that names none gets the
        first model that fits the route, one it prefers first (chat: a model with a chat
        template; when none fits, 404 saying what each serves)."""
        if (named := self.models.named(name)) is not None:
            return named
        if len(self.models.all) == 1:
            return self.models.default
        if (none_fits := needs.none_fits(self.models.all)) is not None:
            raise NoModelFits(none_fits)
        fitting = [model for model in self.models.all if needs.missing(model) is None]
        return min(fitting, key=needs.rank)  # (of equals, the first listed)

"""A served model as the routes see it: its name and its serving side (the `Serving`
face of `rawserve.serving`), with the refusals of that side turned into HTTP errors on
the way (by `rawserve.api.outcomes`).

Several models may be served at once; `ServedModels` finds the one a request names, the
first being the default for routes that name none.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import PurePath
from typing import Any

from rawserve.api.outcomes import http_error
from rawserve.http.errors import BadRequest, ModelNotFound
from rawserve.serving.face import (
    NO_CONTROL,
    Control,
    ItemResult,
    ModelLimits,
    Refused,
    Serving,
)


@dataclass(frozen=True)
class ServedModel:
    name: str  # what clients call it: its alias, else the Hub id or the folder's name
    serving: Serving
    facts: Mapping[str, Any] = field(default_factory=dict)  # its options, for /info
    aliases: tuple[str, ...] = ()  # other names it answers to (the Hub id beside an alias)
    longest_deadline: float | None = None  # seconds X-Request-Timeout may ask (--max-timeout)
    # a token stream that ended with an error event, by its status (for /metrics: its
    # head went out as 200, which the access line and the request counts say)
    count_stream_error: Callable[[int], None] = lambda status: None

    @property
    def names(self) -> tuple[str, ...]:
        return (self.name, *self.aliases)

    @property
    def task(self) -> str | None:
        """The loaded model's task; None until a worker has loaded it."""
        loaded = self.serving.loaded
        return loaded.task if loaded else None

    @property
    def known_task(self) -> str | None:
        """The task as far as it is known: the loaded model's, else the one the server
        was started with (its folder's, or the one named): /openapi.json is asked for
        while the model loads, and described it for no task."""
        return self.task or self.facts.get("task")

    @property
    def positions(self) -> int:
        """The most tokens the loaded model reads of an input (its worker's
        `max_input_length`); 0 until a worker has loaded it."""
        loaded = self.serving.loaded
        return int(loaded.details.get("max_input_length") or 0) if loaded else 0

    @property
    def thinking(self) -> str | None:
        """Where the loaded model's thinking opens, if it is a reasoning model (its
        worker's `thinking`: `rawserve.api.reasoning`); None for one that does not reason."""
        loaded = self.serving.loaded
        return loaded.details.get("thinking") if loaded else None

    @property
    def limits(self) -> ModelLimits:
        """What the loaded model can take (unknown until a worker is ready)."""
        loaded = self.serving.loaded
        return loaded.limits if loaded else ModelLimits()

    async def run(
        self,
        inputs: Sequence[Any],
        params: Mapping[str, Any],
        deadline: float,
        control: Control = NO_CONTROL,
    ) -> list[ItemResult]:
        """The items' results in order; HTTPError when the serving side refuses them."""
        try:
            return await self.serving.run(inputs, params, deadline, control)
        except Refused as refused:
            raise http_error(refused.refusal, self.longest_deadline) from None

    def refuse_if_busy(self, deadline: float) -> None:
        """Raise the 503 any request due at `deadline` would get now, whatever its body:
        the queue full, or the wait for a generation's row past the deadline."""
        refusal = self.serving.admission(deadline)
        if refusal is not None:
            raise http_error(refusal, self.longest_deadline)


class ServedModels:
    """The models of one server; the first is the default.

    A request names a model by any of its names (`POST /models/<name>`, the "model" field
    of the OpenAI routes); one that names none gets the default.
    """

    def __init__(self, models: Sequence[ServedModel]):
        if not models:
            raise ValueError("at least one model is served")
        self.all = list(models)
        self.default = self.all[0]
        self._by_name: dict[str, ServedModel] = {}
        for model in self.all:
            for name in model.names:
                if self._by_name.setdefault(name, model) is not model:
                    raise ValueError(f"two served models are both named {name!r}")

    @property
    def names(self) -> list[str]:
        """Every name a request may use, each model's own name first."""
        return list(self._by_name)

    def named(self, name: Any) -> ServedModel | None:
        """The model a body's "model" field names (None: it names none): 400 where it is
        no text. One served model answers to any name, as TEI and TGI do (their clients
        send a placeholder: TGI's sends "tgi"); of several, a name not served is 404
        listing the served ones."""
        if name is None:
            return None
        if not isinstance(name, str):
            raise BadRequest('"model" must be a string', param="model")
        return self.default if len(self.all) == 1 else self.get(name)

    def get(self, name: str | None) -> ServedModel:
        """The model a request names (the default when it names none); 404 otherwise."""
        if name is None:
            return self.default
        model = self._by_name.get(name)
        if model is None:
            served = ", ".join(self._by_name)
            sharing = [m.name for m in self.all if name in source_names(m.facts)]
            if len(sharing) > 1:  # the same folder or Hub id served twice: neither answers to it
                raise ModelNotFound(
                    f"{name[:100]!r} names several served models ({', '.join(sharing)}): "
                    "name one by its alias"
                )
            raise ModelNotFound(f"no model named {name[:100]!r} is served (served: {served})")
        return model


def source_names(facts: Mapping[str, object]) -> tuple[str, ...]:
    """The names a model's source (its facts' `model`: a folder or a Hub id, as given)
    would give it without an alias: the source itself, and a folder's last component (a
    Hub id's, `tinycls` of org/tinycls, names no model: a 404 said it named several)."""
    source = facts.get("model")
    if not isinstance(source, str):
        return ()
    if facts.get("revision") is not None:  # a Hub commit: the source is a Hub id
        return (source,)
    return (source, PurePath(source.rstrip("/") or source).name)

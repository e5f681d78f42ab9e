"""What a task's rules are made of: the `Task` record, how a single input is answered, and
the error a refused input or parameter raises."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from rawserve.tasks.checks import Checker, Schema
from rawserve.tasks.estimate import estimate_tokens

# The new tokens a generation may ask: what its model's positions hold after a one-token
# prompt; where they are unknown (a handler, T5's relative positions) at most
# UNKNOWN_POSITIONS_NEW_TOKENS; and whatever the model, never more than MAX_NEW_TOKENS
# (about the longest contexts served), the bound a body is read to.
MAX_NEW_TOKENS = 2**20
UNKNOWN_POSITIONS_NEW_TOKENS = 4096


class InvalidRequest(ValueError):
    """An input or parameter a task's rules refuse; the message says what to fix."""


class UnknownParameters(InvalidRequest):
    """Parameters a task does not take: the message names every one it does, whole (the
    client's names in it are bounded: `registry.check_params`)."""


class UnservedParameter(InvalidRequest):
    """A parameter the task knows but this server cannot honour with the value given:
    well-formed, and refused (422) rather than ignored."""


class SingleAnswer:
    """How a request with one (non-list) input is answered, from its item's output."""

    ITEM = "item"  # the item's output itself
    # [output], or the output itself when it is a list already (summarization: `pipe("x")`
    # answered [{"summary_text"}], and [{...}, {...}] with num_return_sequences=2)
    LIST = "list"
    LIST_OF_LISTS = "list-of-lists"  # [[...]] (text-classification on the Inference API)


@dataclass(frozen=True)
class Task:
    name: str
    check_input: Checker
    params: Mapping[str, Checker] = field(default_factory=dict)
    required_params: frozenset[str] = frozenset()
    # pipe([x]) answers x's output itself instead of a one-item list (fill-mask does).
    unwraps_single: bool = False
    # The Inference API sends this task's parameters at the top level of the body
    # (feature-extraction: `{"inputs": ..., "normalize": true}`), not under "parameters".
    params_at_root: bool = False
    # Parameters the worker knows by another name, the client's name first: TGI's
    # `frequency_penalty` is not OpenAI's (which the OpenAI routes send the worker).
    worker_names: Mapping[str, str] = field(default_factory=dict)
    # Top-level fields besides inputs/parameters/options (text-generation: "stream").
    extra_fields: frozenset[str] = frozenset()
    single_answer: str = SingleAnswer.ITEM
    # Reshapes one item's output from the runner's to the Inference API's shape.
    shape_item: Callable[[Any], Any] | None = None
    # A body that is not JSON is one input as bytes (an image), not UTF-8 text.
    binary_input: bool = False
    # One item's output in the Inference API's shape, as JSON Schema (for /openapi.json).
    output_schema: Schema = field(default_factory=dict)
    # An input's cost in tokens before a worker reads it: a text's from its length (the
    # default), an image's from the pixels its header declares.
    estimate: Callable[[Any], int] = estimate_tokens

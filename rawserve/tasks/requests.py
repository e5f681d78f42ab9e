"""Requests and answers, for every task: check a body against the task's rules, split a
model call's answer into one output per input, and shape the JSON answer.

The registry `TASKS` gathers the per-task modules; this is the one place that applies
their rules (which inputs are valid, which parameters are allowed, which pipelines drop
the outer list of a one-item call, how a single input is answered).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rawserve.errors import BadRequest
from rawserve.tasks import (
    feature_extraction,
    fill_mask,
    image_classification,
    question_answering,
    seq2seq,
    text_classification,
    text_generation,
    token_classification,
    zero_shot_classification,
)
from rawserve.tasks.rules import SingleAnswer, Task

TASKS: dict[str, Task] = {
    task.name: task
    for task in [
        feature_extraction.TASK,
        fill_mask.TASK,
        text_classification.TASK,
        token_classification.TASK,
        zero_shot_classification.TASK,
        text_generation.TASK,
        question_answering.TASK,
        *seq2seq.TASKS,
        image_classification.TASK,
    ]
}

# Tasks served by a custom handler take any JSON input and any parameters.
CUSTOM_TASK = "custom"


@dataclass(frozen=True)
class ParsedRequest:
    inputs: list[Any]
    params: dict[str, Any]
    is_list: bool  # answer a list (the client sent a list of inputs)
    stream: bool = False  # answer text/event-stream, one event per new token


def task_rules(name: str) -> Task | None:
    return TASKS.get(name)


def parse_json_body(task_name: str, document: Any) -> ParsedRequest:
    """Check an Inference-API shaped body `{"inputs": X, "parameters": {...}}`."""
    if not isinstance(document, dict) or "inputs" not in document:
        raise BadRequest('the JSON body must be an object with an "inputs" field')
    task = task_rules(task_name)
    known_fields = {"inputs", "parameters", "options"}
    if task is not None:
        known_fields |= task.extra_fields
        if task.params_at_root:
            known_fields |= set(task.params)
    unknown_fields = set(document) - known_fields
    if unknown_fields:
        raise BadRequest(f"unknown field(s): {', '.join(sorted(unknown_fields))}")
    raw_inputs = document["inputs"]
    is_list = isinstance(raw_inputs, list)
    items = raw_inputs if is_list else [raw_inputs]
    if not items:
        raise BadRequest('"inputs" must not be an empty list')
    params = document.get("parameters")
    if params is None:
        params = {}
    if not isinstance(params, dict):
        raise BadRequest('"parameters" must be an object')
    if task is None:  # custom handler: it validates what it is given
        return ParsedRequest(list(items), dict(params), is_list)
    if task.params_at_root:
        params = {**params, **{k: v for k, v in document.items() if k in task.params}}
    stream = document.get("stream")
    if stream not in (None, True, False):
        raise BadRequest('"stream" must be true or false')
    if stream and is_list:
        raise BadRequest("a streamed answer takes one input, not a list")
    return ParsedRequest(
        [check_input(task, item) for item in items],
        check_params(task, params),
        is_list,
        stream=bool(stream),
    )


def parse_text_body(task_name: str, text: str) -> ParsedRequest:
    """A raw (non-JSON) body is one input, as `curl -d` sends it."""
    task = task_rules(task_name)
    item = text if task is None else check_input(task, text)
    if task is not None:
        check_params(task, {})  # a task with required parameters needs JSON
    return ParsedRequest([item], {}, is_list=False)


def takes_binary_body(task_name: str | None) -> bool:
    """Whether a non-JSON body is this task's input as bytes (an image) rather than text."""
    task = task_rules(task_name) if task_name else None
    return task is not None and task.binary_input


def parse_binary_body(task_name: str, body: bytes) -> ParsedRequest:
    """A raw body for a task that takes bytes: one input, queued as base64 text."""
    if not body:
        raise BadRequest("the body is empty: send the image's bytes")
    return ParsedRequest([image_classification.image_from_body(body)], {}, is_list=False)


def check_input(task: Task, item: Any) -> Any:
    try:
        return task.check_input(item)
    except ValueError as exc:
        raise BadRequest(f"invalid input for {task.name}: {exc}") from None


def check_params(task: Task, params: Mapping[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(params) - set(task.params))
    if unknown:
        allowed = ", ".join(sorted(task.params)) or "none"
        raise BadRequest(
            f"unknown parameter(s) for {task.name}: {', '.join(unknown)} (allowed: {allowed})"
        )
    missing = sorted(task.required_params - set(params))
    if missing:
        raise BadRequest(f"missing required parameter(s) for {task.name}: {', '.join(missing)}")
    checked = {}
    for name, value in params.items():
        if value is None:  # clients such as InferenceClient send explicit nulls
            continue
        try:
            checked[name] = task.params[name](value)
        except ValueError as exc:
            raise BadRequest(f"parameter {name!r} {exc}") from None
    return checked


def batch_key(params: Mapping[str, Any]) -> str:
    """Items share a model call only when their parameters are equal."""
    return json.dumps(params, sort_keys=True, separators=(",", ":"))


def estimate_tokens(item: Any) -> int:
    """A cheap token-count estimate without a tokenizer (about 4 characters a token)."""
    if isinstance(item, str):
        return 2 + len(item) // 4
    if isinstance(item, dict):
        return 2 + sum(len(v) // 4 for v in item.values() if isinstance(v, str))
    return 1


def split_outputs(task_name: str, inputs: Sequence[Any], raw: Any) -> list[Any]:
    """Turn one pipeline call's answer into one output per input.

    A pipeline called on a one-item list may answer the item's output without the
    outer list (fill-mask does); this is the one place that knows which tasks do.
    """
    task = task_rules(task_name)
    if len(inputs) == 1 and task is not None and task.unwraps_single:
        raw = [raw]
    if not isinstance(raw, list) or len(raw) != len(inputs):
        raise RuntimeError(
            f"{task_name} answered {len(raw) if isinstance(raw, list) else 'a non-list'} "
            f"outputs for {len(inputs)} inputs"
        )
    if task is not None and task.shape_item is not None:
        return [task.shape_item(output) for output in raw]
    return list(raw)


def shape_answer(task_name: str | None, outputs: list[Any], is_list: bool) -> Any:
    """The JSON answer to a request, from its items' outputs (in the Inference API's shape).

    A list of inputs is answered by the list of outputs. One input is answered by its
    output, except where the Inference API (and so InferenceClient) expects a list.
    """
    if is_list:
        return outputs
    [output] = outputs
    task = task_rules(task_name) if task_name else None
    if task is None or task.single_answer == SingleAnswer.ITEM:
        return output
    if task.single_answer == SingleAnswer.LIST_OF_LISTS:
        return [output if isinstance(output, list) else [output]]
    return [output]
